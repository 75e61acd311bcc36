"""Qwen3-Next (`qwen3_next`) from a tiny random transformers checkpoint (hf_families' "qwen3_next": three Gated
DeltaNet layers to one gated attention layer, MoE with a gated shared expert and a dense layer): the first loss
of a run equals transformers' loss on the same batch, on one device and on fsdp2 × tp2 (the key-head groups and
the experts' hidden split over tp). Its logits (1e-4) and bitwise export round trip are test_hf_interop.py's,
its greedy generation test_generate_hf.py's, like every family's."""

import numpy as np
import pytest

import hf_families as H
from harness import eval_loss, step_fns
from jaxllm.interop import hf

SEQ, ROWS = 32, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return H.build("qwen3_next", str(tmp_path_factory.mktemp("qwen3_next") / "model"))


def transformers_loss(path: str, windows: np.ndarray) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # labels shift inside: the loss of each window's SEQ next-token predictions
        return float(model(input_ids=torch.as_tensor(windows), labels=torch.as_tensor(windows)).loss)


@pytest.mark.parametrize("mesh", [{}, {"mesh.fsdp": 2, "mesh.tp": 2, "train.zero_stage": 3}])
def test_first_loss_equals_transformers(checkpoint, mesh):
    windows = H.sample_tokens(H.VOCAB_SIZE, ROWS, SEQ + 1, seed=3).astype(np.int64)
    cfg = hf.config_for(checkpoint, {"model.seq_len": SEQ, "train.global_batch": ROWS, "mesh.dp": 1,
                                     "precision.compute": "float32", **mesh})
    params = hf.load_params(checkpoint, cfg.model)
    total, count, _ = eval_loss(step_fns(cfg), params, windows)
    want = transformers_loss(checkpoint, windows)
    assert abs(float(total) / float(count) - want) <= 1e-5 * want
