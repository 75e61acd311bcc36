"""Greedy exact-match accuracy of a model on held-out fine-tuning examples.

    jaxllm exact-match --from runs/sft --data heldout.jsonl [--limit 200] [--step N] [key=value ...]

Each line of `--data` (the run's `data.format`: chat, prompt_completion or preference) is a request: the
prompt (for chat, every message before the last, with the template's generation prompt) and the reference
reply (the last message, the assistant's; a preference pair's chosen completion). The model generates
greedily, on the run's mesh, until a stop id or `--max-new-tokens`; a reply matches when its text equals the
reference, both stripped of surrounding whitespace. `--step 0` measures the run's starting parameters (its init.from, or its seed's random
ones): accuracy before fine-tuning. Prints `exact_match K/N = P%`; a problem is one line, exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

from jaxllm import cli

log = logging.getLogger("jaxllm")


def parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="jaxllm exact-match", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", required=True, help="a run directory, hf:DIR or gguf:FILE")
    p.add_argument("--data", required=True, help="a JSONL file of held-out examples")
    p.add_argument("--limit", type=cli.count, default=0, help="the first N examples only (0: all)")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=32)
    p.add_argument("--batch", type=cli.positive_int, default=64, help="requests generated together")
    p.add_argument("--step", type=int, default=None, help="a checkpoint step; 0: the starting parameters")
    p.add_argument("overrides", nargs="*", help="run keys, e.g. mesh.tp=2 data.format=chat")
    return p


def run(args) -> None:
    import jaxllm
    from jaxllm.errors import DataError

    if not os.path.isfile(args.data):  # before the model loads
        raise DataError(f"--data: no such file '{args.data}'; give a JSONL file of held-out examples")
    model = jaxllm.load(args.source, args.step, args.overrides)
    result = model.exact_match(args.data, limit=args.limit, max_new_tokens=args.max_new_tokens, batch=args.batch)
    for prompt, text, reply in list(zip(result.prompts, result.texts, result.replies))[:3]:
        log.info("e.g. %r -> %r (reference %r)", model.tokenizer.decode(np.asarray(prompt, np.uint32)), text, reply)
    print(f"exact_match {result.matches}/{len(result.prompts)} = {100 * result.accuracy:.1f}%")


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_with_overrides(parser(), argv)
    return cli.run(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
