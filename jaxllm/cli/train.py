"""`jaxllm train [--config NAME|FILE] [key=value ...]`: train a model as configured.

With no arguments: jaxllm/configs/default.toml, a small GPT on the Python standard
library's source, on this machine's devices. Any mistake in the config, data or run
directory is reported as one line `error: ...` with exit code 2 and nothing written.
"""

from __future__ import annotations

import sys

from jaxllm import cli


def main(argv: list[str] | None = None, prog: str = "jaxllm train") -> int:
    """`prog` names the command in messages: `python -m experiments.run` calls this too."""
    args = cli.config_parser(prog, __doc__.splitlines()[0]).parse_args(argv)

    def go():
        import jaxllm

        jaxllm.train(cli.load_config(args))

    return cli.run(go)


if __name__ == "__main__":
    sys.exit(main())
