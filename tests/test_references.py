"""One device equals the independent references, and the references catch the bugs they are for.

`tools/reference/plain_gpt.py` and `tools/reference/plain_llama.py` (with its dense mixture of experts) share no code
with `jaxllm/models/`. jaxllm's one-device loss and gradients equal theirs (fp32, loss within
1e-5, each gradient leaf within 1e-4 relative + 1e-8), for GPT-2, LLaMA with grouped-query
attention, and MoE (top-2 and top-1 with a shared expert, dropless, auxiliary losses included).
Every parallel form's own test file compares its meshes with the same references.

Mutants: each test breaks one piece of jaxllm's model by monkeypatching it — RoPE rotating the
swapped halves, query heads grouped onto KV heads in the wrong order, top-k gates not
renormalised, RMSNorm subtracting the mean, a LLaMA head read from the embedding — and checks
that the comparison with the reference then fails.
"""

import jax
import jax.numpy as jnp
import pytest
from einops import rearrange

from harness import assert_matches, equivalence_config, loss_and_grads, reference, step_fns
from jaxllm.config import validate
from jaxllm.mesh import make_mesh
from jaxllm.models import attention, layers, moe, transformer
from jaxllm.trainer.step import make_step_fns

MODELS = {
    "gpt2": ("tiny-gpt2", {}),
    "llama_gqa": ("tiny-llama", {}),
    "moe_top2": ("tiny-moe", {"model.moe.capacity_factor": 0.0}),
    "moe_top1_gated_shared": ("tiny-moe", {"model.moe.capacity_factor": 0.0, "model.moe.top_k": 1,
                                           "model.moe.n_shared_experts": 2, "model.moe.shared_gate": True}),
}


@pytest.mark.parametrize("model", MODELS)
def test_one_device_equals_the_reference(model):
    preset, over = MODELS[model]
    cfg = equivalence_config(preset, **over)
    ref = reference(cfg.model)
    loss, grads = loss_and_grads(step_fns(cfg), ref[0])
    assert_matches(loss, grads, ref)


def fresh_one_device(preset: str, **over):
    """A one-device step built now (not from the registry), so it traces the patched model."""
    cfg = equivalence_config(preset, **over)
    return make_step_fns(cfg, make_mesh(validate(cfg, 1)[0], cfg, devices=jax.devices()[:1])), reference(cfg.model)


def rope_halves_swapped(rope):
    def mutant(x, positions, freqs, scale=1.0):
        first, second = jnp.split(x, 2, axis=-1)
        return rope(jnp.concatenate([second, first], axis=-1), positions, freqs, scale)

    return mutant


def heads_grouped_wrongly(attend):
    """Query head h attends to KV head h % kv instead of h // (heads / kv): `(g k)` for `(k g)`."""
    def mutant(q, k, v, *rest):
        g = q.shape[2] // k.shape[2]
        out = attend(rearrange(q, "b t (g k) d -> b t (k g) d", g=g), k, v, *rest)
        return rearrange(out, "b t (k g) d -> b t (g k) d", g=g)

    return mutant


def gates_not_renormalised(route):
    def mutant(router_w, x, top_k, *routing):
        logits, probs, _, experts = route(router_w, x, top_k, *routing)
        return logits, probs, jnp.take_along_axis(probs, experts, axis=-1), experts

    return mutant


def rms_norm_subtracting_the_mean(rms_norm):
    def mutant(p, x, eps, offset=0.0):
        return rms_norm(p, x - jnp.mean(x, axis=-1, keepdims=True), eps, offset)

    return mutant


def head_from_the_embedding(logits):
    def mutant(params, x, m, dtype):
        tied = {k: v for k, v in params.items() if k != "head"}
        return logits(tied, x, type(m)(**{**vars(m), "tie_embeddings": True}), dtype)

    return mutant


MUTANTS = {  # name -> (module, attribute, mutant maker, model)
    "rope_halves_swapped": (attention, "rope", rope_halves_swapped, "llama_gqa"),
    "gqa_heads_grouped_g_k": (attention, "attention", heads_grouped_wrongly, "llama_gqa"),
    "topk_gates_not_renormalised": (moe, "route", gates_not_renormalised, "moe_top2"),
    "rms_norm_subtracts_mean": (layers.NORMS, "rmsnorm", rms_norm_subtracting_the_mean, "llama_gqa"),
    "llama_head_read_from_embedding": (transformer, "_logits", head_from_the_embedding, "llama_gqa"),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_the_reference_catches_the_mutant(name, monkeypatch):
    module, attribute, make, model = MUTANTS[name]
    if isinstance(module, dict):  # a table of functions the model looks up by name
        monkeypatch.setitem(module, attribute, make(module[attribute]))
    else:
        monkeypatch.setattr(module, attribute, make(getattr(module, attribute)))
    preset, over = MODELS[model]
    fns, ref = fresh_one_device(preset, **over)
    loss, grads = loss_and_grads(fns, ref[0])
    with pytest.raises(AssertionError):
        assert_matches(loss, grads, ref)
