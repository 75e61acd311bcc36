"""`python -m experiments.run [--config FILE] [key=value ...]`: train a model as configured.

With no arguments: experiments/configs/default.toml, a small GPT on the Python standard
library's source, on this machine's devices. Any mistake in the config, data or run
directory is reported as one line `error: ...` with exit code 2 and nothing written.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.toml")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help=f"TOML config file (default: {os.path.relpath(DEFAULT_CONFIG)})")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100 mesh.fsdp=4")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from jaxllm.config import build_config
    from jaxllm.errors import UserError

    try:
        cfg = build_config(args.config or DEFAULT_CONFIG, args.overrides)
        from jaxllm.train.loop import train

        train(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
