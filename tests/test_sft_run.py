"""SFT as a user runs it: an imported Hugging Face model with its tokenizer and chat template starts at the
loss transformers computes on the assistant tokens (one device and dp×fsdp×tp); a run resumed in the
middle of an epoch repeats the uninterrupted losses bit for bit; the addition example learns."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hf_families as H
from harness import REPO, subprocess_env
from jaxllm.config import build_config
from jaxllm.trainer.loop import train

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"

CHATS = [
    [{"role": "user", "content": "Name a number."}, {"role": "assistant", "content": "42"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The fox?"},
     {"role": "assistant", "content": "It jumps over the lazy dog."}, {"role": "user", "content": "And then?"},
     {"role": "assistant", "content": "Nothing: we're sure it's fine."}],
    [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "hello, world"}],
    [{"role": "user", "content": "Version?"}, {"role": "assistant", "content": "v1.2.3, Python 3.11"}],
]


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def write_chats(path: Path, chats) -> str:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return str(path)


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory):
    """A tiny random LLaMA saved by transformers, with the test tokenizer and Meta's LLaMA 3 chat template
    (no generation tags) beside it: what a user downloads."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    tok = json.loads((FIXTURES / "hf_tokenizer" / "tokenizer.json").read_text())
    vocab = max(t["id"] for t in tok["added_tokens"]) + 1
    H.build("llama3", str(folder), vocab_size=vocab)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(FIXTURES / "hf_tokenizer" / f, folder / f)
    (folder / "chat_template.jinja").write_text((TEMPLATES / "llama3.jinja").read_text())
    return folder


def transformers_assistant_nll(folder: Path, chats, tagged: str = "llama3_tagged.jinja") -> float:
    """transformers' mean NLL over the assistant tokens of every chat: its tokenizer's mask from the tagged
    twin of the model's template, its model's logits in fp32 (eager attention: Gemma 2's soft cap)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    total, count = 0.0, 0
    for chat in chats:
        out = tok.apply_chat_template(chat, chat_template=(TEMPLATES / tagged).read_text(),
                                      tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], bool)
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor(ids[None])).logits[0].double().numpy()
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        picked = logp[np.arange(len(ids) - 1), ids[1:]]  # position p predicts token p+1
        total -= float(picked[mask[1:]].sum())
        count += int(mask[1:].sum())
    return total / count


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["one device, the command line", "dp2 x fsdp2 x tp2"])
def test_an_imported_model_starts_at_transformers_assistant_loss(llama_with_tokenizer, tmp_path, mesh):
    """The README's command (jaxllm/configs/sft.toml, init.from and data.tokenizer the model's folder) on
    one device, and the same run in this process on 8 devices: the first step's loss is transformers'."""
    folder = llama_with_tokenizer
    over = {"init.from": f"hf:{folder}", "data.tokenizer": f"hf:{folder}",
            "data.source": write_chats(tmp_path / "chats.jsonl", CHATS), "data.val_percent": 0, "data.pack": "false",
            "model.seq_len": 128, "train.global_batch": len(CHATS), "train.epochs": 1, "train.checkpoint_every": 0,
            "precision.compute": "float32", "run.dir": str(tmp_path / "run"), "run.progress": "false"}
    args = [f"{k}={v}" for k, v in over.items()]
    if mesh.startswith("one"):
        done = subprocess.run([sys.executable, "-m", "jaxllm", "train", "--config", "sft",
                               *args], cwd=REPO, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    else:
        train(build_config(str(REPO / "jaxllm/configs/sft.toml"),
                           args + ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.zero_stage=3"]))
    ref = transformers_assistant_nll(folder, CHATS)
    assert abs(losses(tmp_path / "run")[1] - ref) <= 1e-4 * ref, (losses(tmp_path / "run")[1], ref)


FAMILY_CHATS = {  # (the family's template, the one the run uses: the template itself for Gemma, the tagged twin
    # for Qwen3, whose own refuses two-turn chats (tests/test_sft_data.py); the special tokens it needs)
    "gemma2": ("gemma", "gemma.jinja", ["<start_of_turn>", "<end_of_turn>"]),
    "gemma3": ("gemma", "gemma.jinja", ["<start_of_turn>", "<end_of_turn>"]),
    "qwen3": ("qwen3", "qwen3_tagged.jinja", ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_CHATS)
def test_qwen3_and_gemma_start_at_transformers_assistant_loss(family, tmp_path):
    """A tiny random model of the family with the test tokenizer (its turn tokens added) and the family's
    template, one- and two-turn chats, on dp2 × fsdp2 × tp2: the first loss is transformers' NLL over the
    assistant tokens its tagged twin marks."""
    from tokenizers import AddedToken, Tokenizer

    name, template, tokens = FAMILY_CHATS[family]
    folder = tmp_path / family
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(FIXTURES / "hf_tokenizer" / f, folder / f)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tok.save(str(folder / "tokenizer.json"))
    H.build(family, str(folder), vocab_size=tok.get_vocab_size(with_added_tokens=True))
    (folder / "chat_template.jinja").write_text((TEMPLATES / f"{name}.jinja").read_text())
    over = {"init.from": f"hf:{folder}", "data.tokenizer": f"hf:{folder}",
            "data.chat_template": str(TEMPLATES / template),
            "data.source": write_chats(tmp_path / "chats.jsonl", CHATS), "data.val_percent": 0, "data.pack": "false",
            "model.seq_len": 128, "train.global_batch": len(CHATS), "train.epochs": 1, "train.checkpoint_every": 0,
            "precision.compute": "float32", "run.dir": str(tmp_path / "run"), "run.progress": "false"}
    train(build_config(str(REPO / "jaxllm/configs/sft.toml"), [f"{k}={v}" for k, v in over.items()]
                       + ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.zero_stage=3"]))
    ref = transformers_assistant_nll(folder, CHATS, f"{name}_tagged.jinja")
    assert abs(losses(tmp_path / "run")[1] - ref) <= 1e-4 * ref, (losses(tmp_path / "run")[1], ref)


@pytest.mark.slow
def test_a_resume_in_the_middle_of_an_epoch_repeats_the_losses(tmp_path):
    """Packed rows, 8 per step, the last batch of each epoch short of rows; 2 epochs on dp2 × fsdp4 (ZeRO-1).
    A run stopped one step into its second epoch (its newer checkpoints gone, as after a kill) and resumed
    logs the same losses, bitwise; validation covers the whole split and falls."""
    rng = np.random.default_rng(0)
    chats = [[{"role": "user", "content": "".join(rng.choice(list("abcdefgh"), rng.integers(2, 9)))},
              {"role": "assistant", "content": "".join(rng.choice(list("0123456789"), rng.integers(1, 12)))}]
             for _ in range(70)]
    over = {"data.format": "chat", "data.source": write_chats(tmp_path / "c.jsonl", chats), "data.pack": True,
            "data.val_percent": 10, "model.preset": "tiny-llama", "model.seq_len": 128, "train.global_batch": 8,
            "train.epochs": 2, "train.checkpoint_every": 1, "train.keep_checkpoints": 20, "train.log_every": 1,
            "train.eval_every": 100, "precision.compute": "float32", "run.sample_tokens": 0, "run.progress": False,
            "mesh.dp": 2, "mesh.fsdp": 4, "train.zero_stage": 1, "train.lr": 3e-3, "train.warmup_steps": 1}
    full, part = tmp_path / "full", tmp_path / "part"
    train(build_config(None, {**over, "run.dir": str(full)}))
    ref = losses(full)
    per_epoch = len(ref) // 2
    assert per_epoch >= 2 and sorted(ref) == list(range(1, 2 * per_epoch + 1))
    shutil.copytree(full, part)
    for step in range(per_epoch + 2, 2 * per_epoch + 1):
        shutil.rmtree(part / "checkpoints" / str(step))
    train(build_config(None, {**over, "run.dir": str(part), "train.resume": True}))
    assert losses(part) == ref
    rows = [json.loads(line) for line in open(full / "metrics.jsonl")]
    assert all(0 < r["padding_frac"] < 1 for r in rows if "loss" in r)
    assert [r["step"] for r in rows if "val_loss" in r] == [2 * per_epoch]


@pytest.mark.slow
def test_the_addition_example_learns(tmp_path):
    """The README's example, short: its data script, its config for 2 epochs instead of 10, and
    jaxllm exact-match on 100 held-out sums, as a user runs them. After 2 epochs the reply loss has fallen
    from ln 257 ≈ 5.5 to about 0.8 and a few held-out sums come out right (4-13% here, from 0% before;
    10 epochs: 100%, BENCHMARKS.md): the bars are a validation loss under 1.0 and 2%."""
    data, run_dir = tmp_path / "addition", tmp_path / "run"
    # XLA's usual optimisation, not the suite's cheap compiles: 240 steps run 2.4 times faster for 3 s more compiling
    env = {**subprocess_env(1), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}

    def cli(*args) -> str:
        done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    cli("tools.examples.make_addition", str(data))
    cli("jaxllm", "train", "--config", "sft_addition", f"data.source={data / 'train.jsonl'}",
        f"run.dir={run_dir}", "train.epochs=2", "train.eval_every=1000", "run.progress=false")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert rows[0]["loss"] > 5.0 and [r["val_loss"] for r in rows if "val_loss" in r][-1] < 1.0
    out = cli("jaxllm", "exact-match", "--from", str(run_dir), "--data", str(data / "heldout.jsonl"), "--limit", "100")
    assert float(out.split("= ")[-1].rstrip("%\n")) >= 2.0, out
