"""LoRA against full fine-tuning on the addition example, as a user runs them.

    python -m tools.studies.lora_addition [OUT_DIR] [--pretrain-epochs 12] [--finetune-steps 300] [--rank 8]

1. Data (`tools.examples.make_addition`): every two-digit sum a + b as a chat, 300 pairs held out; the pre-training
   set is the training pairs with a < 50 only.
2. Pre-train the example's model (`jaxllm/configs/sft_addition.toml`) on it for --pretrain-epochs.
3. Fine-tune from that checkpoint on all training pairs for --finetune-steps, once fully and once with LoRA
   (`model.lora.rank` = --rank on all seven targets, the base frozen), same steps, batch and schedule; LoRA's
   learning rate is --lora-lr (adapters start at zero and are commonly trained at a higher rate).
4. `jaxllm exact-match` of the three checkpoints on the 300 held-out pairs, split into a < 50 and a ≥ 50.

Prints a Markdown table; with --json one more line of everything. About 6 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tools.examples import make_addition


def jaxllm_cli(*args: str) -> str:
    """`jaxllm ARGS` from this checkout: its stdout; a failure ends the tool with the command's last line."""
    run = subprocess.run([sys.executable, "-m", "jaxllm", *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    if run.returncode:
        raise SystemExit(f"jaxllm {' '.join(args[:2])} failed: {run.stderr.strip().splitlines()[-1]}")
    return run.stdout


def _data(out: Path) -> dict:
    make_addition.write(out)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    low = [r for r in rows if int(r["messages"][0]["content"].split("+")[0]) < 50]
    (out / "pretrain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in low))
    held = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    for name, keep in (("held_low", lambda a: a < 50), ("held_high", lambda a: a >= 50)):
        part = [r for r in held if keep(int(r["messages"][0]["content"].split("+")[0]))]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return {"pretrain": len(low), "finetune": len(rows), "held": len(held)}


def exact_match(run_dir: Path | str, data: Path, *overrides: str) -> tuple[int, int]:
    """(hits, total) of `jaxllm exact-match` on a run's newest checkpoint (or any `--from` source), with run keys."""
    text = jaxllm_cli("exact-match", "--from", str(run_dir), "--data", str(data), *overrides)
    hits, total = re.search(r"exact_match (\d+)/(\d+)", text).groups()
    return int(hits), int(total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.studies.lora_addition", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="runs/lora_addition")
    p.add_argument("--pretrain-epochs", type=int, default=12)
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3, help="full fine-tuning's learning rate")
    p.add_argument("--lora-lr", type=float, default=1e-2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    counts = _data(out / "data")
    common = ["--config", "sft_addition", "run.progress=false", "train.eval_every=0", "run.sample_tokens=0"]
    pre = out / "pretrain"
    seconds = {}
    start = time.perf_counter()
    jaxllm_cli("train", *common, f"run.dir={pre}", f"data.source={out / 'data' / 'pretrain.jsonl'}",
            f"train.epochs={args.pretrain_epochs}")
    seconds["pretrain"] = time.perf_counter() - start
    tune = [*common, f"init.from=run:{pre}", f"data.source={out / 'data' / 'train.jsonl'}", "train.epochs=0",
            f"train.steps={args.finetune_steps}", f"train.checkpoint_every={args.finetune_steps}"]
    runs = {"pre-trained (a < 50)": pre}
    for name, keys in (("full fine-tuning", [f"train.lr={args.lr}"]),
                       (f"LoRA r = {args.rank}", [f"train.lr={args.lora_lr}", f"model.lora.rank={args.rank}"])):
        runs[name] = out / name.split()[0].lower()
        start = time.perf_counter()
        jaxllm_cli("train", *tune, f"run.dir={runs[name]}", *keys)
        seconds[name] = time.perf_counter() - start
    table = {name: {part: exact_match(d, out / "data" / f"{part}.jsonl") for part in ("held_low", "held_high")}
             for name, d in runs.items()}
    print("| checkpoint | held-out a < 50 | held-out a ≥ 50 | all held-out | train s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in table.items():
        (lo, n_lo), (hi, n_hi) = r["held_low"], r["held_high"]
        train_s = seconds.get(name, seconds["pretrain"])
        print(f"| {name} | {lo}/{n_lo} | {hi}/{n_hi} | {100 * (lo + hi) / (n_lo + n_hi):.1f}% | {train_s:.0f} |")
    if args.json:
        print(json.dumps({"counts": counts, "args": vars(args), "seconds": seconds, "exact_match": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
