"""`jaxllm SUBCOMMAND ...`: the one command an installed jaxllm has.

Each subcommand is a module of this package with its own `main(argv)` and parser (prog
`jaxllm NAME`): everything after the subcommand's name goes to it unchanged, so a module
behaves the same called here or on its own. A subcommand's module is imported only when it
runs, so `jaxllm --help` does not load JAX.
"""

from __future__ import annotations

import importlib
import sys

from jaxllm.cli import ArgumentParser

# name -> (module, one line for `jaxllm --help`); a new subcommand is one more row.
COMMANDS = {
    "train": ("jaxllm.cli.train", "train a model as configured"),
    "generate": ("jaxllm.cli.generate", "generate text from a run or hf:DIR with the KV cache"),
    "hf": ("jaxllm.cli.hf", "import a Hugging Face model, or export a run to one"),
    "plan": ("jaxllm.cli.plan", "a train step's memory and collectives per device"),
    "prepare-data": ("jaxllm.cli.prepare_data", "tokenize text once into llm.c .bin shards"),
    "exact-match": ("jaxllm.cli.exact_match", "greedy exact-match accuracy on held-out examples"),
    "eval": ("jaxllm.cli.eval", "benchmark tasks as lm-evaluation-harness runs them"),
}


def parser() -> ArgumentParser:
    """The top-level parser: it shows the table and rejects what is not a subcommand; it parses no
    subcommand's options (their own parsers do)."""
    p = ArgumentParser(prog="jaxllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", title="subcommands",
                           metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, help_line) in COMMANDS.items():
        sub.add_parser(name, help=help_line, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        top = parser()
        top.parse_args(argv)  # --help exits 0; a wrong subcommand or option, one line and exit 2
        top.error(f"give a subcommand: {', '.join(COMMANDS)}")
    module, _ = COMMANDS[argv[0]]
    return importlib.import_module(module).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
