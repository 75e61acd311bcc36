"""The rollout engine (`jaxllm/generate/engine.py`: a paged KV cache, continuous batching, shared prompts) against
the static engine (`generate/decode.py`) and one device, fp32.

- Every request's tokens equal the static engine's and its log-probabilities are within 1e-5, greedy and sampled
  (the same seed: request i draws what row i draws), with the requests arriving in three orders, on 4 slots of
  pages of 4 tokens, per-request `max_new_tokens` and prompts repeated (shared); for a LLaMA-shaped model, one
  with sliding windows on alternate layers, and latent attention. Where a greedy token differs, the static
  engine's top-2 margin there must be under 1e-5 (a tie the two programs' rounding may break either way);
  sampled tokens must be equal. The static engine's own per-request `max_new_tokens` (a batch run to the
  largest, each row cut) ends and stops each request where the engine does.
- A prompt of P tokens requested G = 8 times holds ⌈P / page⌉ pages of prompt tokens, + G where P is not a
  multiple of the page (each request's copy of the partial page), counted at the engine's peak; every page is
  free again at the end.
- On four training meshes (ZeRO-3, a pipeline with windowed layers, latent attention, experts) the engine samples
  one device's tokens, its resharding receives the planner's bytes, its decode step gathers no weights, and each
  device holds its own shard's page pools, read and written with no collective of a page's size; the shards'
  first prompts are prefilled by one call. A prefill runs the head on each prompt's last token alone, after the
  final norm over every position (in bf16 its first tokens are the static engine's, within 1e-4).
- The Pallas paged-attention kernel (interpreted) decodes as the gathered pages do, on one device and in its
  island on a mesh; the decode step exported for CUDA calls it; a model it cannot compute is refused.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import equivalence_config, step_fns, tiers
from jaxllm.generate import generate, generate_arrays
from jaxllm.generate.cache import pool_bytes
from jaxllm.generate.decode import bucket, reshard_bytes
from jaxllm.generate import engine as engine_lib
from jaxllm.generate.engine import Engine
from jaxllm.models import transformer
from jaxllm.mesh import batch_shards
from jaxllm.plan.hlo import all_gather_received_bytes, computations, executed_collectives

PAGE, SLOTS, MARGIN = 4, 4, 1e-5
MODELS = {
    "llama": {},
    "moe": {"model.preset": "tiny-moe"},
    "windowed": {"model.sliding_window": 6, "model.window_pattern": ["local", "global"]},
    "mla": {"model.attention": "mla", "model.mla.kv_lora_rank": 16, "model.mla.qk_nope_head_dim": 8,
            "model.mla.qk_rope_head_dim": 4, "model.mla.v_head_dim": 8, "model.mla.q_lora_rank": 0},
}
FAST = ("llama", 0.0)


def _requests():
    """12 prompts of 3-19 tokens, three of them the same as another (shared), and each one's max_new_tokens."""
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(1, 257, rng.integers(3, 20))] for _ in range(12)]
    prompts[3] = prompts[5] = prompts[9] = prompts[1]
    return prompts, [int(n) for n in rng.integers(1, 13, 12)]


def _every_page_free(engine) -> bool:
    """Every page of every shard's pool given back (its page 0 is scratch, never given out)."""
    return all(len(pool.free) == len(pool.holders) - 1 for pool in engine.page_pools)


def _overrides(name: str) -> dict:
    return {"model.init_std": 0.1, "model.seq_len": 64, **MODELS[name]}


def _model(name: str):
    cfg = equivalence_config("tiny-llama", **_overrides(name))
    return cfg, transformer.init_params(cfg.model, jax.random.key(0))


def _case(name, temperature):
    marks = () if (name, temperature) == FAST else (pytest.mark.slow,)
    return pytest.param(name, temperature, marks=marks, id=f"{name}-{'greedy' if temperature == 0 else 'sampled'}")


@pytest.mark.parametrize("name,temperature", [_case(n, t) for n in MODELS if n != "moe" for t in (0.0, 1.0)])
def test_the_engine_equals_the_static_engine_in_any_arrival_order(name, temperature):
    cfg, params = _model(name)
    prompts, new = _requests()
    static = generate_arrays(params, cfg, prompts, max(new), temperature=temperature, seed=3, keep_logits=True)
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE)
    for order in (range(12), range(11, -1, -1), np.random.default_rng(1).permutation(12)):
        got = engine.generate(prompts, new, temperature=temperature, seed=3, order=[int(i) for i in order])
        for i, c in enumerate(got):
            assert len(c.tokens) == new[i]  # no stop ids: every request runs to its own length
            want = static["tokens"][i, :new[i]]
            differ = np.flatnonzero(c.tokens != want)
            upto = differ[0] if differ.size else new[i]
            if differ.size:
                top2 = np.sort(static["logits"][i, upto])[-2:]
                assert temperature == 0 and top2[1] - top2[0] < MARGIN, (name, i, upto, top2)
            assert np.max(np.abs(c.logprobs[:upto] - static["logprobs"][i, :upto]), initial=0) <= 1e-5, (name, i)
        assert _every_page_free(engine)


def test_several_decode_steps_a_call_draw_the_same_tokens_and_stop_where_one_step_a_call_does():
    """`steps_per_call` = 3 (the requests' lengths 1-12 end anywhere inside a call), sampled, with stop ids that
    end some requests early (tokens the 1-step engine drew third, for 4 requests): every request's tokens and stop as with one
    step a call, log-probabilities within 1e-5, and every page given back."""
    cfg, params = _model("llama")
    prompts, new = _requests()
    one = Engine(params, cfg, slots=SLOTS, page=PAGE)
    third = [int(c.tokens[2]) for c in one.generate(prompts, new, temperature=1.0, seed=3) if len(c.tokens) > 5]
    stops = third[:4]
    want = one.generate(prompts, new, temperature=1.0, seed=3, stop_ids=stops)
    assert any(c.stopped and len(c.tokens) < n for c, n in zip(want, new))
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE, steps_per_call=3)
    got = engine.generate(prompts, new, temperature=1.0, seed=3, stop_ids=stops, order=list(range(11, -1, -1)))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        assert b.stopped == a.stopped
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    assert engine.stats["decode_steps"] % 3 == 0
    assert _every_page_free(engine)


def test_sending_each_call_before_reading_the_last_changes_no_token():
    """The engine sends each decode call before it reads the previous call's tokens (`overlap`, the default), so the
    host schedules while the device decodes. Against the engine that reads each call's tokens before it sends the
    next, sampled, 2 steps a call, with stop ids that end requests at their first token and inside a call: every
    request's tokens, stop and log-probabilities bit for bit (the same programs on the same inputs), every page
    given back, and every call but the first sent while the one before was unread."""
    cfg, params = _model("llama")
    prompts, new = _requests()
    sync = Engine(params, cfg, slots=SLOTS, page=PAGE, steps_per_call=2, overlap=False)
    plain = sync.generate(prompts, new, temperature=1.0, seed=3)
    plain_steps = sync.stats["decode_steps"]
    firsts = sorted({int(plain[i].tokens[0]) for i in (0, 1)})
    stops = firsts + [t for t in {int(c.tokens[2]) for c in plain[2:] if len(c.tokens) > 4} if t not in firsts][:4]
    want = sync.generate(prompts, new, temperature=1.0, seed=3, stop_ids=stops)
    assert sum(len(c.tokens) == 1 and c.stopped for c in want) >= 2, want  # a request that ends at its first token
    assert sync.stats["overlapped_calls"] == 0
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE, steps_per_call=2)
    engine.generate(prompts, new, temperature=1.0, seed=3)
    assert engine.stats["decode_steps"] == plain_steps  # a slot is free for the call after its last
    got = engine.generate(prompts, new, temperature=1.0, seed=3, stop_ids=stops)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.logprobs, a.logprobs)
        assert b.stopped == a.stopped
    assert engine.stats["overlapped_calls"] == engine.stats["decode_steps"] // 2 - 1 > 0, engine.stats
    assert _every_page_free(engine)


def test_the_static_engine_cuts_each_prompt_at_its_own_length_and_stop_as_the_engine_does():
    """`decode.generate` with one max_new_tokens per prompt (the batch run to the largest, each row cut at its own):
    each request's tokens, stop and log-probabilities as the engine gives them, sampled, with stop ids that end some
    requests before their length and that others draw only past it (those did not stop)."""
    cfg, params = _model("llama")
    prompts, new = _requests()
    whole = generate_arrays(params, cfg, prompts, max(new), temperature=1.0, seed=3)
    short = [i for i, n in enumerate(new) if n < max(new)][:3]
    past = [int(whole["tokens"][i, new[i]]) for i in short]  # drawn just past the request's length
    third = [int(whole["tokens"][i, 2]) for i, n in enumerate(new) if n > 3 and i not in short][:3]  # inside it
    stops = past + third
    want = Engine(params, cfg, slots=SLOTS, page=PAGE).generate(prompts, new, temperature=1.0, seed=3, stop_ids=stops)
    got = generate(params, cfg, prompts, new, temperature=1.0, seed=3, stop_ids=stops)
    cut = generate_arrays(params, cfg, prompts, max(new), temperature=1.0, seed=3, stop_ids=stops)
    assert any(c.stopped and len(c.tokens) < n for c, n in zip(want, new))
    assert any(stopped and length > n for stopped, length, n in zip(cut["stopped"], cut["lengths"], new))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        assert b.stopped == a.stopped
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt_len", [8, 10])
def test_a_prompts_completions_share_its_pages(prompt_len):
    cfg, params = _model("llama")
    group = 8
    engine = Engine(params, cfg, slots=group, page=PAGE)
    prompt = list(range(1, prompt_len + 1))
    engine.generate([prompt] * group, 3, temperature=1.0)
    partial = prompt_len % PAGE != 0
    assert engine.stats["prompt_pages"] == math.ceil(prompt_len / PAGE) + (group if partial else 0)
    assert _every_page_free(engine)


@pytest.mark.slow
def test_a_call_of_fewer_requests_than_slots_decodes_as_many_rows_as_requests():
    """An idle slot's decode step costs a busy one's (attention over a table of scratch pages), so a call of fewer
    requests than the engine's slots runs as many slots as requests (SmolLM2's one 3,000-token prompt on `jaxllm
    generate --prompts`'s 32 slots took 121 s, on one slot 26 s), and the same tokens as a call of them all."""
    cfg, params = _model("llama")
    prompts, new = _requests()
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE)
    few = engine.generate(prompts[:2], new[:2], temperature=1.0, seed=3)
    assert engine.next_tokens.shape == (2,) and len(engine.page_pools[0].holders) == 1 + 2 * (engine.row_pages + 1)
    every = engine.generate(prompts, new, temperature=1.0, seed=3)
    assert engine.next_tokens.shape == (SLOTS,)
    for a, b in zip(every, few):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def test_the_default_pool_is_what_the_slots_need_and_a_smaller_one_makes_requests_wait_for_the_same_tokens():
    """By default each pool holds what every slot's longest request needs at once: with SLOTS different prompts of
    a length that leaves a partial page, each wanting the most tokens, every page but scratch is held at the peak
    (the pool is the least that fits them). With `pages` the least one request needs, the requests wait for pages
    (one at a time) and draw the tokens the default pool draws; fewer pages are refused."""
    from jaxllm.errors import ConfigError

    cfg, params = _model("llama")
    prompts = [[s + 1] * (2 * PAGE + 1) for s in range(SLOTS)]
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE)
    engine.generate(prompts, 3 * PAGE, temperature=1.0)
    assert engine.stats["pages_held"] == len(engine.page_pools[0].holders) - 1
    prompts, new = _requests()
    want = Engine(params, cfg, slots=SLOTS, page=PAGE).generate(prompts, new, temperature=1.0, seed=3)
    least = max(math.ceil((len(p) + n) / PAGE) + (len(p) % PAGE != 0) for p, n in zip(prompts, new)) + 1
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE, pages=least)
    got = engine.generate(prompts, new, temperature=1.0, seed=3)
    assert engine.stats["waits_for_pages"] > 0 and engine.stats["pages_held"] <= least - 1
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    assert _every_page_free(engine)
    with pytest.raises(ConfigError, match=f"cannot hold request .*; give pages >= {least}"):
        Engine(params, cfg, slots=SLOTS, page=PAGE, pages=least - 1).generate(prompts, new)


MESHES = {  # name -> (model, mesh): the engine in the rollout layout from each stored layout
    "dp2_fsdp2_tp2_zero3": ("llama", {"mesh.dp": 2, "mesh.fsdp": 2, "mesh.tp": 2, "train.zero_stage": 3}),
    "pp2_dp2_tp2": ("windowed", {"mesh.pp": 2, "mesh.dp": 2, "mesh.tp": 2, "train.microbatches": 2}),
    "fsdp4_tp2_mla": ("mla", {"mesh.fsdp": 4, "mesh.tp": 2, "train.zero_stage": 3}),
    "ep2_fsdp2_moe": ("moe", {"mesh.ep": 2, "mesh.fsdp": 2, "train.zero_stage": 3}),
}


@pytest.mark.parametrize("name", tiers(MESHES, fast=("dp2_fsdp2_tp2_zero3",)))
def test_the_engine_on_a_mesh_equals_one_device_and_reshards_what_the_planner_says(name):
    """On a training mesh the engine reshards the stored parameters once into the rollout layout (whole over
    fsdp and pp, split over tp; slots and page pools over the data axes), then decodes what one device decodes:
    sampled tokens equal, log-probabilities within 1e-5, each program traced once (prefill once a prompt bucket:
    the host's inputs placed as the programs place what they return). The resharding program's all-gathers bring
    each device `decode.reshard_bytes` (what `jaxllm plan` reports), and a decode step gathers no weights: its
    all-gathers (sampling rows, logits) carry under a tenth of that. Each device holds one shard's pools (1 / B of
    the pages, B the data-parallel shards; a pool whole on every device held them all), and a decode step moves no
    page: no collective of it carries as many bytes as one device's pool of one block kind; `cache.pool_bytes` (the
    planner's) is what a device holds. B new prompts of one length bucket, a request each, go one to a shard and
    are prefilled by one call (a call had one prompt, the other shards' rows idle)."""
    model, mesh = MESHES[name]
    one, params = _model(model)
    cfg = equivalence_config(one.model.preset, **{**_overrides(model), **mesh})
    fns = step_fns(cfg)
    stored = jax.device_put(params, fns.state_shardings.params)
    prompts, new = _requests()
    alone = Engine(params, one, slots=SLOTS, page=PAGE)
    want = alone.generate(prompts, new, temperature=1.0, seed=3)
    engine_lib._compiled.clear()  # programs of its own, traced by this run alone
    engine = Engine(stored, cfg, slots=SLOTS, page=PAGE, on=fns)
    got = engine.generate(prompts, new, temperature=1.0, seed=3, order=list(range(11, -1, -1)))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    traced = {program: getattr(engine.programs, program)._cache_size() for program in ("prefill", "first", "copy_page")}
    assert traced == {"prefill": len({bucket(len(p)) for p in prompts}), "first": 1, "copy_page": 1}
    assert engine.decode._cache_size() == 1  # the host's inputs laid out as the programs leave theirs
    shards = batch_shards(dict(fns.layout.mesh.shape))
    distinct = [prompts[i] for i in range(12) if bucket(len(prompts[i])) == 16 and prompts[i] != prompts[1]][:shards]
    got = engine.generate(distinct, 16, temperature=1.0, seed=3)  # its tables as wide: no program traced again
    assert (engine.stats["prefills"], engine.stats["prefill_calls"]) == (shards, 1)
    for a, b in zip(alone.generate(distinct, 16, temperature=1.0, seed=3), got, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    devices = fns.layout.mesh.devices.size
    received = all_gather_received_bytes(engine.programs.reshard.lower(stored).compile().as_text(), devices)
    assert received == reshard_bytes(cfg.model, jnp.float32, fns) > 0
    idle = np.zeros(engine.slots, np.int32)
    inputs = engine_lib.slot_inputs(idle, idle, idle, idle, idle, engine._table([[]] * len(idle)))
    step = engine.decode.lower(engine.weights, engine.pools, idle, inputs, engine.seed,
                               engine.settings).compile().as_text()
    assert all_gather_received_bytes(step, devices) < received / 10
    pools = [pool for block in engine.pools for pool in block.values()]
    for pool in pools:  # [kv_heads, shards, ...] or, latent, [shards, ...]
        at = int(pool.ndim == 6)
        assert pool.shape[at] == batch_shards(dict(fns.layout.mesh.shape)) > 1
        assert pool.sharding.shard_shape(pool.shape)[at] == 1
    own = min(pool.addressable_shards[0].data.nbytes for pool in pools)
    assert max(c["bytes"] for c in executed_collectives(step)[0]) < own
    held = sum(pool.addressable_shards[0].data.nbytes for pool in pools)  # what `jaxllm plan` reports
    assert pool_bytes(cfg.model, len(engine.page_pools[0].holders), PAGE, jnp.float32, fns) == held


def _ops(hlo: str) -> list[tuple[str, str, tuple]]:
    """(opcode, name, dimensions) of each array-valued instruction of a compiled program."""
    shape = lambda t: tuple(int(d) for d in re.fullmatch(r"\w+\[([\d,]*)\].*", t).group(1).split(",") if d)
    return [(ins["opcode"], ins["name"], shape(ins["type"])) for body in computations(hlo)[0].values()
            for ins in body if not ins["type"].startswith("(")]


def test_a_prefill_runs_the_head_on_each_prompts_last_token_alone():
    """The prefill program's logits are each row's last prompt token's: no array of the compiled program spans
    the bucket's positions and the vocabulary (the head on every position made [rows, bucket, vocab] fp32: 1 GB
    a prompt of 2,048 tokens with a 128k vocabulary, to read one row of it). The final norm still runs over every
    position, as the static engine's does: in bf16 the first tokens' log-probabilities are the static engine's
    within 1e-4 (5e-7 apart here; normed after the slice they were 5e-3 apart, a bf16 rounding of the residual
    that flipped SmolLM2's greedy answer to "What is the capital of France?")."""
    cfg = equivalence_config("tiny-llama", **_overrides("llama"), **{"precision.compute": "bfloat16"})
    params = transformer.init_params(cfg.model, jax.random.key(0))
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE)
    width, vocab = 32, cfg.model.vocab_size
    assert width not in (cfg.model.d_model, cfg.model.d_ff, vocab)  # no weight has the bucket's size
    tokens, table = np.ones((engine.shards, width), np.int32), np.zeros((engine.shards, width // PAGE), np.int32)
    prefill = engine.programs.prefill.lower(engine.weights, engine.programs.pools(pages=1 + width // PAGE), tokens,
                                            np.full(engine.shards, width - 3, np.int32), table).compile().as_text()
    logits = [(op, dims) for op, _, dims in _ops(prefill) if max(dims, default=0) >= vocab]
    assert logits and not [(op, dims) for op, dims in logits if width in dims], logits
    prompts = _requests()[0]
    got = [c.logprobs[0] for c in engine.generate(prompts, 1, temperature=0.0)]
    want = generate_arrays(params, cfg, prompts, 1, temperature=0.0)["logprobs"][:, 0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_decode_step_copies_no_weight_and_no_gathered_page():
    """The compiled decode step (XLA's gather path) reads the weights and the gathered pages where they lie.
    Weights: the engine holds each layer's weights as arrays of their own (`transformer.per_repeat`) and runs the
    layers unrolled, so no op outputs an array of a weight's shape by slicing or copying (a layer scan sliced
    every layer's weights out of the stack, a copy of all of them at every step). Pages: each layer's are gathered
    into [rows, kv_heads, slots, head_dim], the order both of attention's dots read (`attention.cache_read`,
    kv_layout "bksd"), so nothing the size of a layer's gathered keys or values is written but by the gathers
    (they were transposed twice a layer, each time a layer's whole cache read and written again)."""
    cfg, params = _model("llama")
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE, paged_kernel="xla")
    engine.generate([[1, 2, 3]], 2, temperature=0.0)
    per_row, idle = 8, np.zeros(SLOTS, np.int32)
    inputs = engine_lib.slot_inputs(idle, idle, idle, idle, idle, np.zeros((SLOTS, per_row), np.int32))
    step = engine.decode.lower(engine.weights, engine.programs.pools(pages=1 + SLOTS * per_row), idle, inputs,
                               engine.seed, engine.settings).compile().as_text()
    ops = _ops(step)
    moves = lambda op, name: op in ("copy", "transpose", "slice", "dynamic-slice") or name.startswith(
        ("copy", "transpose", "slice", "dynamic-slice"))
    # a layer's matrices (the stack's leaves less their repeats; its norms' scales are vectors of an activation's width)
    weights = {w.shape[1:] for w in jax.tree.leaves(params["blocks"]) if w.ndim >= 3}
    assert len(weights) >= 4, weights
    assert not [name for op, name, dims in ops if dims in weights and moves(op, name)]
    gathered = SLOTS * per_row * PAGE * cfg.model.n_kv_heads * cfg.model.d_model // cfg.model.n_heads
    big = [(op, name) for op, name, dims in ops if math.prod(dims) >= gathered]
    assert not [name for op, name in big if moves(op, name)], big
    assert sum(op == "fusion" and name.startswith("gather") for op, name in big) >= 2, big  # a layer's keys, values


def test_a_windowed_layers_decode_step_gathers_only_the_pages_its_window_sees():
    """Windowed layers keep their savings: a decode step's local layer (window 6 on pages of 4) gathers each row's
    ⌈5 / 4⌉ + 1 = 3 pages around its window (`attention.in_window`), its global layer all 8 of the row's table
    (the engine against the static engine with this model: `test_the_engine_equals_the_static_engine_in_any_
    arrival_order[windowed-*]`)."""
    cfg, params = _model("windowed")
    engine = Engine(params, cfg, slots=SLOTS, page=PAGE, paged_kernel="xla")
    engine.generate([[1, 2, 3]], 2, temperature=0.0)
    width, idle, d = 8, np.zeros(SLOTS, np.int32), cfg.model.d_model // cfg.model.n_heads
    inputs = engine_lib.slot_inputs(idle, idle, idle, idle, idle, np.zeros((SLOTS, width), np.int32))
    step = engine.decode.lower(engine.weights, engine.programs.pools(pages=1 + SLOTS * width), idle, inputs,
                               engine.seed, engine.settings).compile().as_text()
    shape = lambda t: [int(n) for n in re.fullmatch(r"\w+\[([\d,]*)\].*", t).group(1).split(",") if n]
    pages = sorted(math.prod(dims[:-2]) // (SLOTS * cfg.model.n_kv_heads)  # a layer's gathered keys or values
                   for dims in (shape(ins["type"]) for body in computations(step)[0].values() for ins in body
                                if ins["opcode"] == "gather" and not ins["type"].startswith("("))
                   if dims[-2:] == [PAGE, d])
    assert pages == [3, 3, width, width]


TRITON = "__gpu$xla.gpu.triton"
KERNEL_MODEL = {"model.head_dim": 16, "model.n_kv_heads": 2, "model.attn_softcap": 5.0}  # GQA, soft cap, Triton's dots


@pytest.mark.parametrize("mesh", tiers([None, "dp2_fsdp2_tp2_zero3"], fast=(None,)))
def test_the_paged_kernel_decodes_as_the_gather_does(mesh):
    """A decode step on JAX's Pallas paged-attention kernel (interpreted on CPU; pages of 16, grouped queries,
    a soft cap), on one device and in its island on dp2×fsdp2×tp2: the tokens of the gathered pages, the
    log-probabilities within 1e-5."""
    one = equivalence_config("tiny-llama", **_overrides("llama"), **KERNEL_MODEL)
    params = transformer.init_params(one.model, jax.random.key(0))
    prompts, new = _requests()
    want = Engine(params, one, slots=SLOTS, page=16, paged_kernel="xla").generate(prompts, new, temperature=1.0, seed=3)
    cfg, on, given = one, None, params
    if mesh is not None:
        cfg = equivalence_config("tiny-llama", **_overrides("llama"), **KERNEL_MODEL, **MESHES[mesh][1])
        on = step_fns(cfg)
        given = jax.device_put(params, on.state_shardings.params)
    engine = Engine(given, cfg, slots=SLOTS, page=16, on=on, paged_kernel="pallas_gpu")
    assert engine.kernel == ("pallas_gpu", True)
    for a, b in zip(want, engine.generate(prompts, new, temperature=1.0, seed=3), strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def _kernel_for_cuda(width: int, tuning=None) -> str:
    """The paged kernel's program for 4 rows of tables `width` pages wide (8 query heads over 2 KV heads of 64,
    64-token pages), exported for CUDA from this CPU machine, as MLIR text (`tuning` None: the kernel's default)."""
    from jaxllm.ops import paged_attention
    from jaxllm.ops.masking import Masking

    q = jax.ShapeDtypeStruct((4, 1, 8, 64), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 128, 64, 64), jnp.bfloat16)
    tables, lengths = jax.ShapeDtypeStruct((4, width), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)
    given = {} if tuning is None else {"tuning": tuning}  # none given: as the engine calls it
    attend = jax.jit(lambda q, k, v, t, n: paged_attention.attend(q, k, v, t, n, Masking(), **given))
    exported = jax.export.export(attend, platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])
    return exported(q, pool, pool, tables, lengths).mlir_module()


def test_the_paged_kernel_lowers_for_cuda_at_any_table_width():
    """The kernel's Triton lowering takes arrays of power-of-two sizes only: the pages of a compute block are a
    power of two at every table width (3 stopped a decode of 2,112 positions in 64-token pages on an H200), and the
    kernel lowers for CUDA, on this CPU machine, at widths whose partitions held 3, 5, 6 and 7 pages."""
    from jaxllm.ops import paged_attention

    for width in range(1, 1025):
        splits, block, padded = paged_attention.partitions(width)
        assert block & (block - 1) == 0 and padded >= width and padded % (splits * block) == 0, (width, block)
    for width in (33, 70, 90, 100):
        assert TRITON in _kernel_for_cuda(width)


def test_the_paged_kernel_launches_with_the_tuning_given(tmp_path, monkeypatch):
    """`paged_attention.Tuning` reaches the Triton call (its grid's partitions, warps and stages, in the program
    exported for CUDA), and every tuning's compute blocks stay a power of two; tools.bench.paged_kernel's sweep, in
    Pallas's interpreter on a tiny shape, finds each launch shape computing attention over the gathered pages, and
    `tools.bench.engine_decode --tuning-from` its JSON launches the kernel as its fastest shape (timed here by
    hand: the interpreter times nothing)."""
    import argparse
    import json

    from jaxllm.ops import paged_attention
    from tools.bench import engine_decode, paged_kernel

    for tuning in (paged_attention.DEFAULT, paged_attention.Tuning(4, 2, 4, 3), paged_attention.Tuning(32, 16, 8, 1)):
        for width in (1, 7, 33, 100, 257):
            splits, block, padded = paged_attention.partitions(width, tuning)
            assert block & (block - 1) == 0 and padded >= width and splits <= tuning.max_splits, (tuning, width)
    text = _kernel_for_cuda(33, paged_attention.Tuning(8, 2, 4, 3))
    assert re.search(r"grid_y = 8\b", text) and "num_warps = 4" in text and "num_stages = 3" in text
    shapes = paged_kernel.sweep(equivalence_config("tiny-llama", **{"precision.compute": "bfloat16"}),
                                argparse.Namespace(rows=2, prompt=60, new=8, page=16, splits=[2], blocks=[1],
                                                   warps=[4], stages=[2], interpret=True))
    assert len(shapes) == 2 and all(s["error"] < 1e-2 for s in shapes), shapes  # bf16 inputs, a float32 reference
    timed = [{**s, "seconds": t, "computes_attention": True} for s, t in zip(shapes, (2e-3, 1e-3))]
    (tmp_path / "sweep.json").write_text("| the table |\n" + json.dumps({"shapes": timed}))
    monkeypatch.setattr(paged_attention, "DEFAULT", paged_attention.DEFAULT)  # restored after the test
    engine_decode._tune(str(tmp_path / "sweep.json"))
    assert paged_attention.DEFAULT == paged_attention.Tuning(2, 1, 4, 2)  # the second, faster shape
    text = _kernel_for_cuda(33)
    assert re.search(r"grid_y = 2\b", text) and "num_warps = 4" in text


def test_the_decode_step_exported_for_cuda_calls_the_paged_kernel_and_auto_picks_it_where_it_fits():
    """The engine's decode step exported for CUDA from this CPU machine calls Triton (the paged kernel) with it,
    on the pools of every repeat of the layer (read in place: slicing a layer's pool out copied it whole, 4.2 of a
    10.6 ms decode step on the H200), and not with XLA's gather; `auto` is the gather on CPU; a model the kernel
    cannot compute is refused."""
    from jaxllm.errors import ConfigError

    cfg = equivalence_config("tiny-llama", **_overrides("llama"), **KERNEL_MODEL)
    engine = Engine(transformer.init_params(cfg.model, jax.random.key(0)), cfg, slots=SLOTS, page=16)
    assert engine.kernel == (None, False)
    idle = np.zeros(SLOTS, np.int32)
    args = (engine.weights, engine.programs.pools(pages=9), idle,
            engine_lib.slot_inputs(idle, idle, idle, idle, idle, np.zeros((SLOTS, 2), np.int32)), np.uint32(0),
            (np.float32(1), np.int32(0), np.float32(1)))
    heads, _, repeats, n_pages, page, d = args[1][0]["k"].shape  # one shard on one device
    whole = f"tensor<{heads}x{repeats * n_pages}x{page}x{d}x"  # every repeat's pages, read in place, not sliced out
    for kernel, called in (("pallas_gpu", True), (None, False)):
        decode = engine_lib._programs(engine.m, engine.dtype, 16, None, (kernel, False)).decoder(1)
        exported = jax.export.export(decode, platforms=["cuda"],
                                     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])
        calls = [line for line in exported(*args).mlir_module().splitlines() if TRITON in line]
        assert bool(calls) == called and all(line.count(whole) == 2 for line in calls), kernel
    windowed, _ = _model("windowed")
    with pytest.raises(ConfigError, match="paged_kernel=pallas_gpu: the kernel does not compute this model"):
        Engine(transformer.init_params(windowed.model, jax.random.key(0)), windowed, page=16, paged_kernel="pallas_gpu")
    with pytest.raises(ConfigError, match="the engine's slots must be 1 or more, got 0"):  # it would loop forever
        Engine(engine.weights, cfg, slots=0)
