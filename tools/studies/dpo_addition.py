"""The preference example, as a user runs it, with its control.

    python -m tools.studies.dpo_addition [OUT_DIR] [--sft-epochs 3] [--steps 600] [--beta 2.0] [--lr 3e-4] [--plot PNG]

1. Data (`tools.examples.make_addition`): every two-digit sum a + b as a chat, 300 held out.
2. SFT: the fine-tuning example (`jaxllm/configs/sft_addition.toml`) for --sft-epochs, short of perfect.
3. Pairs (`tools.examples.make_addition_pairs --from` the SFT run): each sum's right answer chosen, the SFT model's own
   greedy mistake rejected (a near miss where it answered right); the held-out sums likewise.
4. DPO (`jaxllm/configs/dpo_addition.toml`) from the SFT model on the training pairs; and the control, the same
   run on the same pairs with chosen and rejected swapped at random (`--shuffled`).
5. On the 300 held-out pairs: the preference accuracy (the share whose chosen reward β·log π/π_ref is strictly
   above the rejected one's) and margin; and greedy exact match (`jaxllm exact-match`) of the three models.

Prints a Markdown table; with --json one more line of everything; --plot writes the two runs' reward accuracy and
margin against the step, with the held-out values. About 8 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from tools.examples import make_addition, make_addition_pairs
from tools.studies.lora_addition import exact_match, jaxllm_cli


def heldout_preference(run_dir: Path, pairs: Path) -> dict:
    """The preference loss and metrics of a DPO run's last checkpoint over every pair of `pairs`, each batch scored by
    the run's reference, as the run's validation computes them."""
    import jax

    from jaxllm.api import step_fns_for
    from jaxllm.config import build_config
    from jaxllm.data import dataset
    from jaxllm.trainer import loop, preference

    cfg = build_config(str(run_dir / "config.toml"), {"run.dir": str(run_dir), "data.source": str(pairs),
                                                      "data.val_percent": 0})
    tokenizer, _, _ = loop.resolve(cfg)
    data = dataset.load(cfg, tokenizer)
    fns = step_fns_for(cfg)
    params = loop.checkpoint_params(cfg, fns, str(run_dir), None)
    held = preference.Scored(dataclasses.replace(data, val=data.train), fns, loop.reference_params(cfg, fns))
    sums, count = {}, 0.0
    for batch in held.eval_batches(fns.batch_sharding, params):
        total, n, metrics = jax.device_get(fns.eval_loss(params, batch))
        for k, v in {"loss": total, **metrics}.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        count += float(n)
    return {k: v / count for k, v in sums.items()}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plot(runs: dict, held: dict, path: str) -> None:
    """Each run's training reward accuracy and margin against the step (a moving mean over 10 logged steps), the
    held-out values at the last step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for (name, run_dir), color in zip(runs.items(), ("tab:blue", "tab:gray")):
        rows = [r for r in _rows(run_dir) if "loss" in r]
        steps = np.array([r["step"] for r in rows])
        for ax, key in zip(axes, ("rewards/accuracies", "rewards/margins")):
            values = np.array([r[key] for r in rows])
            smooth = np.convolve(values, np.ones(10) / 10, mode="valid")
            ax.plot(steps[9:], smooth, color=color, label=f"{name} (train)")
            ax.plot(steps[-1], held[name][key], "o", color=color, label=f"{name} (held-out)")
            ax.set_xlabel("step")
            ax.set_title(key)
    axes[0].axhline(0.5, color="k", lw=0.5, ls=":")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.studies.dpo_addition", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="runs/dpo_addition_study")
    p.add_argument("--sft-epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--beta", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--plot", default="", help="a PNG to write (default OUT_DIR/dpo_addition.png)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    seconds, start = {}, time.perf_counter()
    make_addition.write(out / "chats")
    sft = out / "sft"
    jaxllm_cli("train", "--config", "sft_addition", f"run.dir={sft}", f"data.source={out / 'chats' / 'train.jsonl'}",
            f"train.epochs={args.sft_epochs}", "run.progress=false", "train.eval_every=0")
    seconds["sft"] = time.perf_counter() - start
    counts = {name: make_addition_pairs.write(out / name, shuffled=name == "shuffled", model=str(sft))
              for name in ("pairs", "shuffled")}
    runs = {"DPO": out / "dpo", "DPO, shuffled labels": out / "dpo_shuffled"}
    for (name, run_dir), data in zip(runs.items(), ("pairs", "shuffled")):
        start = time.perf_counter()
        jaxllm_cli("train", "--config", "dpo_addition", f"init.from=run:{sft}", f"run.dir={run_dir}",
                f"data.source={out / data / 'train.jsonl'}", f"train.steps={args.steps}",
                f"train.checkpoint_every={args.steps}", f"dpo.beta={args.beta}", f"train.lr={args.lr}",
                "run.progress=false", "train.eval_every=0", "train.log_every=5")
        seconds[name] = time.perf_counter() - start
    heldout = out / "pairs" / "heldout.jsonl"
    held = {name: heldout_preference(run_dir, heldout) for name, run_dir in runs.items()}
    em = {"SFT": exact_match(sft, out / "chats" / "heldout.jsonl"),
          **{name: exact_match(run_dir, heldout) for name, run_dir in runs.items()}}
    plot(runs, held, args.plot or str(out / "dpo_addition.png"))
    print("| model | held-out preference accuracy | held-out margin | held-out exact match | train s |")
    print("|---|---:|---:|---:|---:|")
    for name, (hits, total) in em.items():
        acc = f"{held[name]['rewards/accuracies']:.3f}" if name in held else "—"
        margin = f"{held[name]['rewards/margins']:.3f}" if name in held else "—"
        train_s = seconds["sft" if name == "SFT" else name]
        print(f"| {name} | {acc} | {margin} | {hits}/{total} = {100 * hits / total:.1f}% | {train_s:.0f} |")
    if args.json:
        print(json.dumps({"args": vars(args), "pairs": counts, "seconds": seconds, "heldout": held,
                          "exact_match": em}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
