"""Supervised fine-tuning through the step: the loss is the NumPy NLL of exactly the assistant targets from
the plain reference model run on each example alone; packing changes neither the loss nor the gradients,
and editing one packed example leaves the others' logits bitwise alone; every mesh form computes the
same on packed rows; a mid-epoch resume repeats the uninterrupted losses bit for bit."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import assert_matches, equivalence_config, step_fns, tiers
from jaxllm.config import build_config
from jaxllm.data import dataset, packing
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.models import transformer
from tools.reference import plain_model

BYTE = get_tokenizer("byte")
SFT_SEQ, ROWS = 128, 8


def conversations(n: int = 20, seed: int = 0) -> list:
    """Short chats of random printable text: 1-3 turns, replies of 1-12 characters."""
    rng = np.random.default_rng(seed)
    text = lambda k: "".join(chr(c) for c in rng.integers(33, 127, k))
    return [[m for _ in range(rng.integers(1, 3)) for m in (
        {"role": "user", "content": text(rng.integers(1, 5))},
        {"role": "assistant", "content": text(rng.integers(1, 10))})] for _ in range(n)]


def sft_data(tmp_path, pack: bool, chats=None, **over):
    path = tmp_path / f"chats{int(pack)}.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in (chats or conversations())))
    cfg = build_config(None, {"data.format": "chat", "data.source": str(path), "data.pack": pack,
                              "data.val_percent": 0, "model.seq_len": SFT_SEQ, "train.global_batch": ROWS, **over})
    return dataset.load(cfg, BYTE)


def config(preset: str = "tiny-llama", rows: int = ROWS, **over):
    return equivalence_config(preset, **{"model.seq_len": SFT_SEQ, "train.global_batch": rows, **over})


def params_of(m):
    return jax.device_get(jax.jit(lambda k: transformer.init_params(m, k))(jax.random.key(0)))


def reference(m, params, examples):
    """(loss, gradients): the plain model on each example alone (right-padded, no packing, no segments);
    the loss in float64 NumPy over the targets the assistant wrote, from an independent mask: the targets
    from the start of each reply (found by searching the text) through its end-of-text."""
    module, c = plain_model(m)
    n = max(len(e.ids) for e in examples) - 1
    inputs, targets, mask = (np.zeros((len(examples), n), np.int32) for _ in range(3))
    for i, e in enumerate(examples):
        inputs[i, :len(e.ids) - 1], targets[i, :len(e.ids) - 1] = e.ids[:-1], e.ids[1:]
        raw = bytes(int(t) if t < 256 else 0 for t in e.ids)
        at = 0
        while (at := raw.find(b"Assistant: ", at)) >= 0:
            end = at + len("Assistant: ") + raw[at + len("Assistant: "):].index(b"\0")  # the reply's EOT
            mask[i, at + len("Assistant: ") - 1:end] = 1  # the target at position p is token p+1
            at = end
    logits = np.asarray(jax.jit(lambda p: module.logits(module.from_jaxllm(p), inputs, c)[0])(params), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    logp = np.take_along_axis(logits, targets[..., None].astype(np.int64), -1)[..., 0] - logz
    loss = float(np.sum(-logp * mask) / mask.sum())

    def nll(p):
        out, _ = module.logits(module.from_jaxllm(p), jnp.asarray(inputs), c)
        lp = jnp.take_along_axis(jax.nn.log_softmax(out), jnp.asarray(targets)[..., None], -1)[..., 0]
        return jnp.sum(-lp * mask) / mask.sum()

    return loss, jax.device_get(jax.jit(jax.grad(nll))(params))


def loss_and_grads(fns, params, batch):
    loss, _, grads = fns.loss_and_grads(jax.device_put(params, fns.state_shardings.params),
                                        jax.device_put(batch, fns.batch_sharding))
    return float(loss), jax.device_get(grads)


_cache: dict = {}


def packed_case(tmp_path_factory):
    """(examples, packed batch of ROWS rows, parameters, reference loss and gradients), built once."""
    if "case" not in _cache:
        data = sft_data(tmp_path_factory.mktemp("sft"), pack=True)
        assert len(data.train) <= ROWS, len(data.train)  # 20 chats packed into the batch's rows
        which = np.concatenate([np.arange(len(data.train)), np.full(ROWS - len(data.train), packing.EMPTY)])
        m = config().model
        params = params_of(m)
        _cache["case"] = (data.train.examples, packing.build(data.train, which), params,
                          reference(m, params, data.train.examples))
    return _cache["case"]


def test_sft_loss_is_the_numpy_nll_of_the_assistant_targets(tmp_path_factory):
    examples, batch, params, (ref_loss, ref_grads) = packed_case(tmp_path_factory)
    loss, grads = loss_and_grads(step_fns(config()), params, batch)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss, (loss, ref_loss)
    assert_matches(loss, grads, (params, ref_loss, ref_grads))
    # a mask one token off (each reply's first target dropped) lands 100 times the tolerance away
    shifted = dict(batch, loss_mask=batch["loss_mask"] * (np.roll(batch["loss_mask"], 1, 1) > 0))
    assert abs(loss_and_grads(step_fns(config()), params, shifted)[0] - ref_loss) > 1e-4 * ref_loss


def test_packed_and_unpacked_rows_give_the_same_loss_and_gradients(tmp_path_factory):
    examples, packed, params, _ = packed_case(tmp_path_factory)
    unpacked = packing.build(packing.make_rows(examples, SFT_SEQ, pack=False, seed=0), np.arange(len(examples)))
    a_loss, a_grads = loss_and_grads(step_fns(config()), params, packed)
    b_loss, b_grads = loss_and_grads(step_fns(config(rows=len(examples))), params, unpacked)
    assert abs(a_loss - b_loss) <= 1e-5 * b_loss
    assert_matches(a_loss, a_grads, (params, b_loss, b_grads), loss_rtol=1e-5, grad_rtol=1e-5)


@pytest.mark.parametrize("preset, over", [("tiny-llama", {}), ("tiny-moe", {"model.moe.capacity_factor": 0.0})])
def test_editing_one_packed_example_leaves_the_others_logits_bitwise(tmp_path_factory, preset, over):
    examples, batch, _, _ = packed_case(tmp_path_factory)
    m = config(preset, **over).model

    @jax.jit
    def logits(params, b):
        x = transformer.embed(params, b["inputs"], b["positions"], m, jnp.float32)
        x, _ = transformer.blocks(params["blocks"], x, b["positions"], b["segment_ids"], m, jnp.float32)
        return transformer.head_logits(params, x, m, jnp.float32)

    params = params_of(m)
    row = int(np.argmax((batch["segment_ids"] == 3).any(1)))  # a row with three or more examples
    edited = dict(batch, inputs=batch["inputs"].copy())
    second = np.flatnonzero(batch["segment_ids"][row] == 2)
    edited["inputs"][row, second] = (edited["inputs"][row, second] + 7) % 256  # same length, other tokens
    a, b = np.asarray(logits(params, batch)), np.asarray(logits(params, edited))
    others = batch["segment_ids"] != 2
    others[np.arange(ROWS) != row] = True
    assert np.array_equal(a[others], b[others])
    assert not np.array_equal(a[row, second], b[row, second])


MESHES = {  # the forms SFT runs on, each on packed rows (fp32)
    "zero1_island": ("tiny-llama", {"mesh.dp": 2, "mesh.fsdp": 2, "train.zero_stage": 1, "train.microbatches": 2}),
    "zero3_fsdp": ("tiny-llama", {"mesh.fsdp": 8, "train.zero_stage": 3}),
    "tp_sequence_parallel": ("tiny-llama", {"mesh.dp": 2, "mesh.tp": 4, "train.sequence_parallel": True}),
    "sp_zigzag_ring": ("tiny-llama", {"mesh.sp": 4, "mesh.dp": 2, "model.cp_load_balance": True}),
    "pipeline": ("tiny-llama", {"mesh.pp": 2, "mesh.dp": 2, "mesh.tp": 2, "train.microbatches": 2}),
}


@pytest.mark.parametrize("mesh", tiers(MESHES, fast=()))
def test_sft_on_every_mesh_equals_the_reference(tmp_path_factory, mesh):
    examples, batch, params, ref = packed_case(tmp_path_factory)
    preset, over = MESHES[mesh]
    loss, grads = loss_and_grads(step_fns(config(preset, **over)), params, batch)
    assert_matches(loss, grads, (params, *ref))


@pytest.mark.slow
def test_sft_with_experts_over_ep_equals_one_device(tmp_path_factory):
    """Expert parallelism on packed rows, dropless: the same loss and gradients as one device (the plain
    model's MoE sees other batches, so one device is the reference here)."""
    _, batch, _, _ = packed_case(tmp_path_factory)
    one = config("tiny-moe", **{"model.moe.capacity_factor": 0.0})
    params = params_of(one.model)
    ref_loss, ref_grads = loss_and_grads(step_fns(one), params, batch)
    loss, grads = loss_and_grads(step_fns(config("tiny-moe", **{"model.moe.capacity_factor": 0.0, "mesh.ep": 4,
                                                               "mesh.fsdp": 2})), params, batch)
    assert_matches(loss, grads, (params, ref_loss, ref_grads))
