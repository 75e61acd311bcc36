"""`train.loss_chunk = -1`, the default (`transformer.default_loss_chunk`): the head computes its logits in chunks
where a token's fp32 logits outweigh its residual stream over the layers, whole elsewhere.

- The rule's choice on the presets and the shipped configs: chunks divide seq_len in multiples of sp, hold at
  least MIN_LOSS_CHUNK positions, and each chunk's logits fit the residual stream's bytes where that many
  positions allow; configs whose logits are no larger, or whose sequence is one chunk, run whole (so their
  losses are bitwise as before).
- From compilation alone, at vocabulary 128,256 and seq 4,096 (the LLaMA-1B preset's widths on two layers, bf16,
  4 rows a device as the benchmark's batch): the default loss's temporaries (head and loss, with the gradients of
  the head and of the hidden states) are at most a quarter of the whole loss's.
- At seq 512 with the same vocabulary the default (two chunks) and the whole loss agree: the loss within 1e-6
  (relative: one fp32 ulp of a loss near 11.8 is 1e-6) and every gradient leaf as the equivalence helper
  compares them.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from harness import assert_matches, loss_and_grads, step_fns, tokens
from jaxllm.config import build_config, config_path, shipped_configs
from jaxllm.mesh import resolve_mesh_shape
from jaxllm.models import transformer
from jaxllm.trainer import objectives
from jaxllm.trainer.step import loss_chunk, objective_of

FROM_A_RUN = ("dpo_addition", "grpo_arith", "grpo_gsm8k")  # their model is a run's: not built from their file alone


def _config(keys: dict, name: str | None = None):
    return build_config(config_path(name), keys)


def test_the_rule_chunks_where_the_logits_outweigh_the_residual_stream():
    for layers, seq, sp in ((16, 4096, 1), (2, 4096, 1), (2, 4096, 4), (2, 512, 1), (16, 8192, 2)):
        cfg = _config({"model.preset": "llama-1b", "model.n_layers": layers, "model.seq_len": seq,
                       "precision.compute": "bfloat16"})
        m = cfg.model
        chunk = loss_chunk(cfg, {"sp": sp, "tp": 1})
        assert chunk and seq % chunk == 0 and chunk % sp == 0 and chunk >= transformer.MIN_LOSS_CHUNK, (layers, chunk)
        per_chunk = chunk * transformer.logit_bytes_per_token(m)
        if seq // chunk < seq // transformer.MIN_LOSS_CHUNK:  # the floor did not bind: the fewest chunks that fit
            assert per_chunk <= seq * transformer.residual_bytes_per_token(m, "bfloat16") < 2 * per_chunk
    for name in (n for n in shipped_configs() if n not in FROM_A_RUN):  # even with LLaMA 3's vocabulary
        cfg = _config({"model.vocab_size": 128256}, name)
        shape = resolve_mesh_shape(cfg.mesh, 8)
        if cfg.train.loss_chunk == -1:  # the default (tp4_sp sets its own)
            assert (loss_chunk(cfg, shape) == 0) == (cfg.model.seq_len < 2 * transformer.MIN_LOSS_CHUNK), name
    small_vocabulary = _config({"model.preset": "llama-1b", "model.vocab_size": 257, "model.seq_len": 4096})
    assert loss_chunk(small_vocabulary, {"sp": 1, "tp": 1}) == 0  # 1.5 KB of logits a token against 128 KB
    explicit = _config({"model.preset": "llama-1b", "train.loss_chunk": 0})
    assert loss_chunk(explicit, {"sp": 1, "tp": 1}) == 0


def _head_gradient(cfg, rows: int, chunk: int):
    """(the gradient of the head and loss with respect to the head's weights and the hidden states, its abstract
    arguments), bf16 compute."""
    m, terms = cfg.model, objective_of(cfg).token_terms
    params = {k: v for k, v in transformer.param_shapes(m).items() if k in ("final_norm", "head")}
    x = jax.ShapeDtypeStruct((rows, m.seq_len, m.d_model), jnp.bfloat16)
    ints = jax.ShapeDtypeStruct((rows, m.seq_len), jnp.int32)

    def loss(p, x, targets, mask):
        return transformer.head_terms(p, x, {"targets": targets, "loss_mask": mask}, m, jnp.bfloat16, terms, chunk)[0]

    return jax.grad(loss, argnums=(0, 1)), (params, x, ints, ints.update(dtype=jnp.float32))


def _head_temporaries(cfg, rows: int, chunk: int) -> int:
    """Compiled temporaries of the head and loss with the gradients of the head's weights and the hidden states."""
    gradient, args = _head_gradient(cfg, rows, chunk)
    return jax.jit(gradient).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _converts(jaxpr, shape: tuple, in_loop: bool = False) -> list[bool]:
    """For each dtype conversion of an array of `shape` in the program (sub-programs included), whether it runs in
    a loop's body."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and getattr(eqn.invars[0].aval, "shape", None) == shape:
            found.append(in_loop)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _converts(inner, shape, in_loop or eqn.primitive.name in ("scan", "while"))
    return found


def test_the_default_loss_keeps_a_quarter_of_the_whole_losss_temporaries():
    cfg = _config({"model.preset": "llama-1b", "model.n_layers": 2, "model.seq_len": 4096,
                   "precision.compute": "bfloat16"})
    chunk = loss_chunk(cfg, {"sp": 1, "tp": 1})
    whole, chunked = _head_temporaries(cfg, 4, 0), _head_temporaries(cfg, 4, chunk)
    assert chunk and chunked <= whole / 4, (chunk, chunked / whole)


def test_the_chunked_backward_casts_the_head_once_and_sums_its_gradient_in_fp32():
    """`models/chunked_loss`: the head's weight is cast to bf16 once, outside the chunk loop, and its gradient is
    summed over the chunks in the loop's fp32 carry; JAX's transpose of the rematerialised scan cast the weight in
    every chunk and widened every chunk's bf16 gradient (a pass over [d_model, vocab] each, on the H200 8.1 ms of the
    LLaMA-1B step at 4,096 tokens)."""
    cfg = _config({"model.preset": "llama-1b", "model.n_layers": 2, "model.seq_len": 4096,
                   "precision.compute": "bfloat16"})
    chunk, m = loss_chunk(cfg, {"sp": 1, "tp": 1}), cfg.model
    gradient, args = _head_gradient(cfg, 1, chunk)
    in_loop = _converts(jax.make_jaxpr(gradient)(*args).jaxpr, (m.d_model, transformer.padded_vocab(m)))
    assert chunk and in_loop and not any(in_loop), (chunk, in_loop)


@pytest.mark.parametrize("objective", [pytest.param("grpo", marks=pytest.mark.slow), "gspo"])
def test_the_written_out_backward_equals_the_whole_losss_for_rl_objectives(objective):
    """`models/chunked_loss` on GRPO's token terms (a temperature, a KL term) and GSPO's sequence stage (per-sequence
    sums whose cotangent reaches every chunk), fp32: the loss and the gradients of the head's weights and of the
    hidden states equal the unchunked head's, which JAX differentiates (within fp32's reordering)."""
    cfg = _config({"model.preset": "tiny-llama", "model.vocab_size": 512, "model.seq_len": 64})
    m = cfg.model
    obj = {"grpo": objectives.grpo(beta=0.1, temperature=0.7), "gspo": objectives.gspo(beta=0.1)}[objective]
    shapes = {k: v for k, v in transformer.param_shapes(m).items() if k in ("final_norm", "head")}
    params = jax.tree.map(lambda a: 0.1 * jax.random.normal(jax.random.key(0), a.shape, a.dtype), shapes)
    k = jax.random.split(jax.random.key(1), 6)
    x = jax.random.normal(k[0], (2, 64, m.d_model))
    batch = {"targets": jax.random.randint(k[1], (2, 64), 0, 512), "weights": jax.random.uniform(k[2], (2, 64)),
             "old_logp": -5 * jax.random.uniform(k[3], (2, 64)), "ref_logp": -5 * jax.random.uniform(k[4], (2, 64)),
             "advantages": jax.random.normal(k[5], (2, 64))}

    def loss(p, x, chunk):
        return transformer.head_terms(p, x, batch, m, jnp.float32, obj.token_terms, chunk, obj.temperature,
                                      functools.partial(objectives.finish, obj))[0]

    (want, want_grads), (got, got_grads) = (jax.value_and_grad(loss, argnums=(0, 1))(params, x, c) for c in (0, 16))
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want)), (float(got), float(want))
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b))), float(jnp.max(jnp.abs(a - b)))


@pytest.mark.slow
def test_at_seq_512_the_default_equals_the_whole_loss():
    keys = {"model.preset": "tiny-llama", "model.vocab_size": 128256, "model.seq_len": 512, "mesh.dp": 1,
            "precision.compute": "float32", "train.global_batch": 1}
    default, whole = _config(keys), _config({**keys, "train.loss_chunk": 0})
    assert loss_chunk(default, {"sp": 1, "tp": 1}) == 256
    fns = step_fns(default, devices=1)
    params, toks = fns.init(0).params, tokens(batch=1, seq=512)
    loss, grads = loss_and_grads(fns, params, toks)
    ref_loss, ref_grads = loss_and_grads(step_fns(whole, devices=1), params, toks)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)), (float(loss), float(ref_loss))
    assert_matches(loss, grads, (None, float(ref_loss), ref_grads))
