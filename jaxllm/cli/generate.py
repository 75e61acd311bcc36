"""Generate text from a trained run or a Hugging Face model directory, with the KV cache.

    jaxllm generate --from runs/mine --prompt "def fib(n):" --max-new-tokens 64 --temperature 0.8
    jaxllm generate --from hf:DIR --prompt "..." --greedy [key=value ...]
    jaxllm generate --from runs/mine --prompts prompts.jsonl [--slots 32] > completions.jsonl
    jaxllm generate --from gguf:SmolLM2-135M-Instruct.Q4_1.gguf --chat --greedy --prompt "What is the capital of France?"

`--from` is a run directory (its config.toml, tokenizer and newest checkpoint, or `--step`), `hf:DIR`
(the model, its tokenizer.json and generation_config.json's stop ids) or `gguf:FILE` (a GGUF file, its tokenizer
and chat template from its metadata). `--chat` asks each prompt as a user turn through the model's chat
template and prints only the answer. Several `--prompt`s generate as
one batch. `--prompts FILE` (JSON lines, each {"prompt": text} or a string; a line's own "max_new_tokens" is
its limit in place of `--max-new-tokens`) generates on the rollout engine
(paged, continuously batched, on the mesh: `jaxllm/generate/engine.py`), for many prompts of different lengths,
and prints one JSON line per prompt in the file's order ({"prompt", "text", "tokens", "stopped"}; with `--chat`
{"prompt", "answer"}). key=value overrides set run keys: the mesh (`mesh.tp=2`), `precision.compute` (the run's,
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
    p.add_argument("--from", dest="source", required=True, help="a run directory, hf:DIR or gguf:FILE")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="text to continue (repeat for a batch)")
    given.add_argument("--prompts", help="a JSON-lines file of prompts, each {\"prompt\": text} (a line's own "
                       "\"max_new_tokens\" too) or a string: generated on the rollout engine, one JSON line out per "
                       "prompt: {prompt, text, tokens, stopped}, with --chat {prompt, answer}")
    p.add_argument("--slots", type=cli.positive_int, default=32,
                   help="with --prompts: the rollout engine's slots, the most prompts decoded at once (default "
                   "32; fewer prompts run on fewer)")
    p.add_argument("--pages", type=cli.count, default=0, help="with --prompts: the pages (16 tokens each) of each "
                   "data-parallel rank's KV-cache pool (default 0: what every slot's longest request needs; fewer "
                   "and requests wait for pages)")
    p.add_argument("--chat", action="store_true", help="ask each prompt as a user turn through the model's chat "
                   "template and print the answers (up to the end of the turn)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="the most new tokens a prompt gets (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument("--greedy", action="store_true", help="the same as --temperature 0")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens only (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of this mass only (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest; 0: the "
                   "parameters it started from)")
    p.add_argument("overrides", nargs="*", help="run keys, e.g. mesh.tp=2 precision.compute=float32")
    return p


def read_prompts(path: str, max_new_tokens: int) -> tuple[list[str], list[int]]:
    """The prompts of a JSON-lines file, each line {"prompt": text, "max_new_tokens": n (optional)} or a JSON
    string, and each one's limit (`max_new_tokens` where the line names none). DataError, one line naming the
    file's line (blank lines skipped, and counted)."""
    from jaxllm.errors import DataError

    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--prompts {path}: {e}; give a JSON-lines file of {{\"prompt\": text}} lines") from None
    rows = [(number, _prompt_line(path, number, line)) for number, line in enumerate(text.splitlines(), 1)
            if line.strip()]
    if not rows:
        raise DataError(f"--prompts {path}: no prompt in the file; give one {{\"prompt\": text}} a line")
    return [r["prompt"] for _, r in rows], [r.get("max_new_tokens", max_new_tokens) for _, r in rows]


def _prompt_line(path: str, number: int, line: str) -> dict:
    """Line `number` of a prompts file as {"prompt": text (, "max_new_tokens": n)}; DataError naming the line."""
    import json

    from jaxllm.errors import DataError

    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"--prompts {path}: line {number}: {e.msg} at column {e.colno}; give a JSON-lines file of "
                        "{\"prompt\": text} lines") from None
    r = {"prompt": r} if isinstance(r, str) else r
    if not isinstance(r, dict) or not isinstance(r.get("prompt"), str):
        raise DataError(f"--prompts {path}: line {number} is not {{\"prompt\": text}} nor a string; give one "
                        "prompt a line")
    n = r.get("max_new_tokens", 1)
    if type(n) is not int or n < 1:
        raise DataError(f"--prompts {path}: line {number}'s max_new_tokens is {n!r}; give a whole number ≥ 1")
    return r


def run(args) -> None:
    import json

    import jaxllm
    from jaxllm.generate.decode import check_sampling

    check_sampling(args.temperature, args.top_k, args.top_p, names=("--temperature", "--top-k", "--top-p"))
    prompts, limits = args.prompt, args.max_new_tokens
    if args.prompts:
        prompts, limits = read_prompts(args.prompts, args.max_new_tokens)
    model = jaxllm.load(args.source, args.step, args.overrides)
    sampling = {"temperature": 0.0 if args.greedy else args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "seed": args.seed, "slots": args.slots if args.prompts else 0, "pages": args.pages}
    if args.chat:
        for question, answer in zip(prompts, model.chat(prompts, limits, **sampling)):
            print(json.dumps({"prompt": question, "answer": answer}) if args.prompts else answer)
        return
    timings = {}
    done = model.generate(prompts, limits, timings=timings, **sampling)
    for p, g in zip(prompts, done):
        print(json.dumps({"prompt": p, "text": g.text, "tokens": g.tokens.tolist(), "stopped": g.stopped})
              if args.prompts else g.text)
    n = sum(len(g.tokens) for g in done)
    log.info("%d new tokens in %.2f s: %.1f tokens/s (compiling took %.1f s)", n, timings["run_s"],
             n / timings["run_s"], timings["compile_s"])


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_with_overrides(parser(), argv)
    return cli.run(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
