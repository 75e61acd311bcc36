"""What every `jaxllm` subcommand shares: `[--config NAME|FILE] [key=value ...]`, logging, user errors.

A `UserError` (bad config, data, checkpoint, a diverged loss) becomes one line `error: ...` on
stderr and exit code 2, with no traceback; a run stopped by a signal, one line `stopped: ...` and
128 + the signal's number. A bad command line is one line too (`ArgumentParser`), exit code 2.
The subcommands themselves are listed in `jaxllm.cli.main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable

from jaxllm.errors import ConfigError, Stopped, UserError

# The shipped configs are package data, found next to this package, so they work from a checkout and installed.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULT_CONFIG = os.path.join(CONFIG_DIR, "default.toml")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line, `PROG: error: MESSAGE`, and exit code 2: the usage block argparse
    prints above it would bury the one thing to fix (`--help` shows it). Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def shipped_configs() -> list[str]:
    """The names `--config NAME` accepts: the .toml files of jaxllm/configs/, without the suffix."""
    return sorted(f[:-len(".toml")] for f in os.listdir(CONFIG_DIR) if f.endswith(".toml"))


def config_path(value: str | None) -> str:
    """The file `--config VALUE` means: none given, the default; a NAME (no slash, no .toml suffix), the
    shipped jaxllm/configs/NAME.toml, so an installed jaxllm needs no checkout; anything else, a path."""
    if value is None:
        return DEFAULT_CONFIG
    if "/" in value or os.sep in value or value.endswith(".toml"):
        return value
    if value not in shipped_configs():
        raise ConfigError(f"--config {value}: no shipped config of that name; choose from "
                          f"{', '.join(shipped_configs())}, or give a TOML file's path")
    return os.path.join(CONFIG_DIR, f"{value}.toml")


def config_parser(prog: str, description: str) -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, metavar="NAME|FILE",
                        help=f"a shipped config's name ({', '.join(shipped_configs())}) or a TOML file "
                             "(default: default)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100 mesh.fsdp=4")
    return parser


def run(main: Callable[[], object]) -> int:
    """Log to stderr, run `main`, turn a UserError into `error: ...` and exit code 2, a stop into `stopped: ...`."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
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

    return build_config(config_path(args.config), args.overrides)
