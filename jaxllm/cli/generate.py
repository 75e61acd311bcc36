"""Generate text from a trained run or a Hugging Face model directory, with the KV cache.

    jaxllm generate --from runs/mine --prompt "def fib(n):" --max-new-tokens 64 --temperature 0.8
    jaxllm generate --from hf:DIR --prompt "..." --greedy [key=value ...]

`--from` is a run directory (its config.toml, tokenizer and newest checkpoint, or `--step`) or `hf:DIR`
(the model, its tokenizer.json and generation_config.json's stop ids). Several `--prompt`s generate as
one batch. key=value overrides set run keys: the mesh (`mesh.tp=2`), `precision.compute` (the run's,
bfloat16 unless set), `distributed.*` for several processes. Prints each prompt with its completion on
stdout and the speed on stderr; any problem is one line `error: ...` and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxllm import cli

log = logging.getLogger("jaxllm")


def parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="jaxllm generate", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", required=True, help="a run directory or hf:DIR")
    p.add_argument("--prompt", action="append", required=True, help="text to continue (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument("--greedy", action="store_true", help="the same as --temperature 0")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens only (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of this mass only (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest; 0: the "
                   "parameters it started from)")
    p.add_argument("overrides", nargs="*", help="run keys, e.g. mesh.tp=2 precision.compute=float32")
    return p


def run(args) -> None:
    import jaxllm

    model = jaxllm.load(args.source, args.step, args.overrides)
    timings = {}
    done = model.generate(args.prompt, args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, timings=timings)
    for g in done:
        print(g.text)
    n = sum(len(g.tokens) for g in done)
    log.info("%d new tokens in %.2f s: %.1f tokens/s (compiling took %.1f s)", n, timings["run_s"],
             n / timings["run_s"], timings["compile_s"])


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_with_overrides(parser(), argv)
    return cli.run(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
