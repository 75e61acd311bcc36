"""What every `jaxllm` subcommand shares: `[--config NAME|FILE] [key=value ...]`, logging, user errors.

A `UserError` (bad config, data, checkpoint, a diverged loss) becomes one line `error: ...` on
stderr and exit code 2, with no traceback; a run stopped by a signal, one line `stopped: ...` and
128 + the signal's number. A bad command line is one line too (`ArgumentParser`), exit code 2.
The subcommands themselves are listed in `jaxllm.cli.main`.
"""

from __future__ import annotations

import argparse
import re

from jaxllm.errors import run  # noqa: F401  (each subcommand's main returns cli.run(...))


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line, `PROG: error: MESSAGE`, and exit code 2: the usage block argparse
    prints above it would bury the one thing to fix (`--help` shows it). Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def positive_int(text: str) -> int:
    """argparse's type for a count that must be 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def count(text: str) -> int:
    """argparse's type for a count that may be 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def config_parser(prog: str, description: str) -> ArgumentParser:
    from jaxllm.config import shipped_configs

    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, metavar="NAME|FILE",
                        help=f"a shipped config's name ({', '.join(shipped_configs())}) or a TOML file "
                             "(default: default)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100 mesh.fsdp=4")
    return parser


OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.\w+)+=")  # section.key=value


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser`'s arguments, with key=value overrides allowed after the options too (all in `overrides`): also
    after an option of several values (`--tasks a.yaml b.yaml mesh.tp=2`), which argparse would give them to."""
    args, extra = parser.parse_known_args(argv)
    if any("=" not in e or e.startswith("-") for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    for action in parser._actions:  # the options that take several words at once (not --prompt's repeats)
        values = getattr(args, action.dest, None)
        if action.option_strings and action.nargs in ("+", "*") and isinstance(values, list):
            kept = [v for v in values if not OVERRIDE.match(str(v))]
            if action.nargs == "+" and not kept:
                parser.error(f"argument {'/'.join(action.option_strings)}: expected at least one argument")
            setattr(args, action.dest, kept)
            extra += [v for v in values if OVERRIDE.match(str(v))]
    args.overrides = [*args.overrides, *extra]
    return args


def load_config(args: argparse.Namespace):
    from jaxllm.config import build_config, config_path

    return build_config(config_path(args.config), args.overrides)
