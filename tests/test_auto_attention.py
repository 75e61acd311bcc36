"""`model.attention_impl = auto` per target platform (`models/attention.choose`): the train step exported for CUDA
and for TPU from this CPU machine (`jax.export`, nothing compiled or run) calls Pallas's Triton kernel and Splash
for plain text, packed SFT rows, latent attention (values narrower than keys) and DPO's pairs, at the LLaMA-1B
preset's widths on two layers and seq 4,096, and packed SFT rows in Ulysses' island over sp = 2; on CPU `auto` builds the step with today's kernel, and the run's
log says what `auto` chose and why. cuDNN cannot be traced without a GPU (its choice is checked on a lent one).
The Pallas kernels run in their own island on a mesh (the partitioner cannot split them): equal to one device.

An export is about a second; one platform's plain case is in the fast tier.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxllm.config import build_config, config_path, validate
from jaxllm.mesh import make_mesh
from jaxllm.models import attention
from jaxllm.ops.attention import dot_product_attention
from jaxllm.ops.masking import Masking
from jaxllm.ops.pallas_attention import IMPLEMENTATIONS as PALLAS
from jaxllm.parallel import kernel_island
from jaxllm.plan.compiled import resolve
from jaxllm.sharding import Layout, param_rules
from jaxllm.trainer.step import make_step_fns
from test_attention_kernels import random_rows

KERNEL_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
CONFIGS = {
    "text": {},
    "packed_sft": {"data.format": "chat", "data.pack": True, "data.source": "tests/fixtures/chats.jsonl"},
    "mla": {"model.attention": "mla", "model.mla.q_lora_rank": 1536, "model.mla.kv_lora_rank": 512,
            "model.mla.qk_nope_head_dim": 128, "model.mla.qk_rope_head_dim": 64, "model.mla.v_head_dim": 128},
    "dpo": {"train.objective": "dpo", "data.format": "preference", "data.source": "tests/fixtures/pairs.jsonl"},
    "packed_sft_ulysses_sp2": {"data.format": "chat", "data.pack": True, "data.source": "tests/fixtures/chats.jsonl",
                               "mesh.sp": 2, "model.cp_strategy": "ulysses"},
}
FAST = ("text", "cuda")


def llama_1b_layers(keys: dict, seq: int = 4096):
    """Two layers at the LLaMA-1B preset's widths, a row of `seq` tokens per device, bf16, resolved as training resolves."""
    cfg = build_config(config_path(None), {"model.preset": "llama-1b", "model.n_layers": 2, "model.seq_len": seq,
                                           "train.global_batch": 8, "precision.compute": "bfloat16", **keys})
    return resolve(cfg)


def exported_step(cfg, shape, platform: str) -> str:
    """The train step of `cfg` on a mesh of `shape`, exported for `platform` from this CPU machine: its StableHLO."""
    fns = make_step_fns(cfg, make_mesh(shape, cfg), platform=platform)
    call = KERNEL_CALLS[platform]
    exported = jax.export.export(fns.train_step, platforms=[platform],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])
    return exported(fns.abstract_state, fns.abstract_batch(8, cfg.model.seq_len)).mlir_module()


def _case(name, platform):
    marks = () if (name, platform) == FAST else (pytest.mark.slow,)
    return pytest.param(name, platform, marks=marks, id=f"{name}-{platform}")


@pytest.mark.parametrize("name,platform", [_case(n, p) for n in CONFIGS for p in KERNEL_CALLS])
def test_the_exported_step_calls_the_platforms_fused_kernel(name, platform):
    cfg, shape, _ = llama_1b_layers(CONFIGS[name])
    assert attention.choose(cfg, platform, shape["sp"])[0] == {"cuda": "pallas_gpu", "tpu": "pallas_tpu"}[platform]
    call = KERNEL_CALLS[platform]
    assert call in exported_step(cfg, shape, platform), f"{name}: no {call} in the train step exported for {platform}"


def test_on_cpu_auto_builds_the_step_with_todays_kernel_and_says_why():
    """CPU keeps its choice (`chunked` from 4,096 tokens, `dense` below), so CPU losses are unchanged; the fused
    kernels are chosen only for their platform, and only where they compute every layer's masks."""
    for seq, kernel in ((4096, "chunked"), (1024, "dense")):
        cfg, shape, _ = llama_1b_layers({}, seq)
        assert attention.for_platform(cfg, "cpu", 1).model.attention_impl == kernel
        assert attention.choose(cfg, "cpu", 1)[0] == kernel
        assert f"attention: {kernel} (model.attention_impl=auto on cpu: " in "\n".join(validate(cfg, 1)[1])
    cfg, _, _ = llama_1b_layers({"model.sliding_window": 1024, "model.window_pattern": ["local", "global"]})
    assert attention.choose(cfg, "cuda", 1) == ("chunked", "the fused kernels take one window for every layer")
    cfg, _, _ = llama_1b_layers({"model.attn_softcap": 50.0})
    impl, why = attention.choose(cfg, "cuda", 1)
    assert impl == "chunked" and "soft cap" in why, why
    assert attention.choose(cfg, "tpu", 1)[0] == "pallas_tpu"  # Splash caps scores itself
    cfg, _, _ = llama_1b_layers({"mesh.sp": 2})
    assert attention.choose(cfg, "tpu", 2)[0] == "chunked"  # the ring's pairs run on the GPU's kernel only
    assert attention.choose(cfg, "cuda", 2) == ("pallas_gpu", "the ring's pairs on pallas_gpu")
    cfg, _, _ = llama_1b_layers({"mesh.sp": 2, "model.cp_strategy": "ulysses"})
    assert attention.choose(cfg, "tpu", 2) == ("pallas_tpu", "Ulysses on pallas_tpu")  # a rank's whole sequence
    assert attention.choose(cfg, "cuda", 2) == ("pallas_gpu", "Ulysses on pallas_gpu")
    cfg, _, _ = llama_1b_layers({"mesh.sp": 2, "model.cp_strategy": "allgather"})
    assert attention.choose(cfg, "cuda", 2)[0] == "chunked"


@pytest.mark.parametrize("impl", PALLAS)
def test_the_kernel_island_equals_one_device_on_dp2_tp2(impl):
    """A Pallas kernel in its island (`parallel/kernel_island.py`, interpret mode) on packed rows split over dp and
    heads over tp: output and dq, dk, dv equal the dense attention of the whole arrays on one device within 1e-5
    (the island's specs put each device's rows and heads together; a wrong one mixes rows or heads)."""
    cfg = build_config(config_path(None), {"model.preset": "tiny-llama", "model.vocab_size": 257, "mesh.dp": 2, "mesh.tp": 2})
    shape, _ = validate(cfg, 4)
    layout = Layout(make_mesh(shape, cfg, devices=jax.devices()[:4]), param_rules(False))
    (q, k, v, d_out), (pos, _, seg, _) = random_rows("island", 128, 4, 2, 16, 8 if impl == "pallas_gpu" else 16,
                                                     1.0, "packed")
    masking = Masking()
    island = lambda q, k, v: kernel_island.attend(q, k, v, pos, seg, layout, masking, impl, interpret=True)
    one = lambda q, k, v: dot_product_attention(q, k, v, pos, pos, seg, seg, masking)
    got = jax.jit(lambda *a: _out_and_grads(island, d_out, *a))(q, k, v)
    want = jax.jit(lambda *a: _out_and_grads(one, d_out, *a))(q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert float(jnp.max(jnp.abs(g - w))) <= 1e-5 * float(jnp.max(jnp.abs(w))), name


def _out_and_grads(f, d_out, q, k, v):
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(d_out))


NESTED = {"pp2_tp2_dp2": {"mesh.pp": 2, "mesh.tp": 2, "mesh.dp": 2, "train.microbatches": 2},
          "dp8_microbatches2_zero1": {"mesh.dp": 8, "train.microbatches": 2, "train.zero_stage": 1}}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", NESTED)
def test_the_kernel_island_nests_in_a_pipeline_stage_and_in_gradient_accumulation(mesh):
    """Splash (whose Mosaic call must see every axis manual) inside a pipeline stage's island (manual over pp) and
    inside ZeRO-1's accumulation island (manual over the batch axes): the island is manual over the rest, and the
    step exported for TPU calls the kernel."""
    cfg, shape, _ = llama_1b_layers({**NESTED[mesh], "model.n_layers": 4, "train.global_batch": 16}, seq=1024)
    fns = make_step_fns(cfg, make_mesh(shape, cfg), platform="tpu")
    exported = jax.export.export(fns.train_step, platforms=["tpu"])
    assert KERNEL_CALLS["tpu"] in exported(fns.abstract_state, fns.abstract_batch(16, 1024)).mlir_module()
