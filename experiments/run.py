"""`python -m experiments.run [--config NAME|FILE] [key=value ...]`: `jaxllm train` from a checkout.

The entry the docs have always shown, kept for a checkout without `pip install`; the code is
jaxllm/cli/train.py, and an installed jaxllm has only the `jaxllm` command.
"""

from __future__ import annotations

import sys

from jaxllm.cli import train


def main(argv: list[str] | None = None) -> int:
    return train.main(argv, prog="python -m experiments.run")


if __name__ == "__main__":
    sys.exit(main())
