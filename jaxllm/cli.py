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


# The distributed keys of a command that reads a training run's config: its own processes (from its
# overrides), not the ones the run trained on.
OWN_PROCESSES = {"distributed.coordinator_address": "", "distributed.num_processes": 0,
                 "distributed.process_id": -1, "distributed.auto": False}


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser`'s arguments, with key=value overrides allowed after the options too (all in `overrides`)."""
    args, extra = parser.parse_known_args(argv)
    if any("=" not in e or e.startswith("-") for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = [*args.overrides, *extra]
    return args


def load_config(args: argparse.Namespace):
    from jaxllm.config import build_config

    return build_config(args.config or DEFAULT_CONFIG, args.overrides)
