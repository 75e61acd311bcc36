"""Evaluate a run or a Hugging Face model on benchmark tasks, as lm-evaluation-harness 0.4 does.

    jaxllm eval --from runs/mine --tasks tasks/arc.yaml tasks/wiki.yaml [--out results.json] [key=value ...]
    jaxllm eval --from hf:DIR --tasks ... [--apply-chat-template [--no-fewshot-as-multiturn]] [--limit N]

Tasks are files in lm-evaluation-harness's task format over local JSONL data (docs/evaluation.md): multiple
choice (acc, acc_norm, acc_bytes), rolling log-likelihood (word and byte perplexity, bits per byte) and greedy
generation (exact match after regex filters), optionally through the tokenizer's chat template. The model runs on
the mesh the overrides give (`mesh.tp=2`), in `precision.compute` (the run's; float32 to compare with another
implementation); requests go `train.global_batch` rows at a time. Prints a table; `--out` writes the metrics and
every request (its log-likelihood, or its generated text) as JSON. A bad task file is one line `error: ...`, exit
code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxllm import cli


def parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="jaxllm eval", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", required=True, help="a run directory, hf:DIR or gguf:FILE")
    p.add_argument("--tasks", nargs="+", required=True, help="task files (YAML or JSON)")
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="build the requests through the tokenizer's chat template (data.chat_template), as "
                        "lm-evaluation-harness's --apply_chat_template (instruct models)")
    p.add_argument("--fewshot-as-multiturn", default=True, action=argparse.BooleanOptionalAction,
                   help="with a chat template, each few-shot example as its own user and assistant turns "
                        "(default; --no-fewshot-as-multiturn: one user message)")
    p.add_argument("--limit", type=float, default=None, help="each task's first N documents only, or below 1 that "
                   "share of them (lm-evaluation-harness's --limit; for trying a task, not for reporting it)")
    p.add_argument("--out", default=None, help="write the results and each request's log-likelihood here (JSON)")
    p.add_argument("overrides", nargs="*", help="run keys, e.g. mesh.tp=2 precision.compute=float32")
    return p


def run(args) -> dict:
    import jaxllm
    from jaxllm.errors import ConfigError
    from jaxllm.eval import tasks as tasks_lib

    # every file, the limit and where the results go checked before the model loads
    tasks = [tasks_lib.first_docs(tasks_lib.load_task(path), args.limit, "--limit") for path in args.tasks]
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise ConfigError(f"--out {args.out}: no folder '{os.path.dirname(args.out)}' to write it in; make it first")
    model = jaxllm.load(args.source, args.step, args.overrides)
    results, samples = model.evaluate(tasks, chat_template=args.apply_chat_template,
                                      fewshot_as_multiturn=args.fewshot_as_multiturn)
    print(f"{'task':<24} {'metric':<30} value")
    for name, values in results.items():
        for metric, value in values.items():
            print(f"{name:<24} {metric:<30} {value:.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": results, "samples": samples}, f, indent=1)
    return results


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_with_overrides(parser(), argv)
    return cli.run(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
