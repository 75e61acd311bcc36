"""What every command-line entry point shares: `[--config FILE] [key=value ...]`, logging, user errors.

A `UserError` (bad config, data, checkpoint, a diverged loss) becomes one line `error: ...` on
stderr and exit code 2, with no traceback; a run stopped by a signal, one line `stopped: ...` and
128 + the signal's number.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "experiments", "configs", "default.toml")


def config_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, help=f"TOML config file (default: {os.path.relpath(DEFAULT_CONFIG)})")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100 mesh.fsdp=4")
    return parser


def run(main: Callable[[], object]) -> int:
    """Log to stderr, run `main`, turn a UserError into `error: ...` and exit code 2, a stop into `stopped: ...`."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from jaxllm.errors import Stopped, UserError

    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def load_config(args: argparse.Namespace):
    from jaxllm.config import build_config

    return build_config(args.config or DEFAULT_CONFIG, args.overrides)
