"""Pipeline parallelism over `pp`: schedule tables, the executor's equivalence, its memory and collectives.

Tables (no JAX): every generated table is a valid program for the executor (each
forward and backward exactly once, dependencies one tick apart, every slot read holds
what the table put there), its bubble equals the formula, and its buffer depth is the
bound the issue states. Executor (8 fake CPU devices, fp32): one step's loss and
gradients equal the independent reference (the 8-layer model in tools/reference/plain_gpt.py or
tools/reference/plain_llama.py), for GPipe and 1F1B on every pair of pp ∈ {2, 4} and microbatches
∈ {4, 8}, interleaved with v = 2, 3D meshes (pp2×fsdp2×tp2 at ZeRO-0, 2 and 3, pp2×dp2×tp2), and
remat and the chunked loss inside stages. Then the compiled programs: 1F1B's temporaries flat
in microbatches and below GPipe's by at least the buffer slots the tables save, and ZeRO-3's
gather-once option leaving no weight all-gather inside the tick loop.
"""

import re

import jax
import numpy as np
import pytest

from harness import (GRAD_RTOL, LOSS_RTOL, assert_matches, equivalence_config, loss_and_grads, lower_loss_and_grads,
                     max_rel_err, reference, step_fns, tiers, train_step)
from jaxllm.config import ConfigError, build_config, validate
from jaxllm.models import transformer
from jaxllm.parallel.pipeline_schedules import (FIELDS, GRADIENT, NOTHING, OUTPUT, Costs, bubble_formula,
                                                bubble_fraction, make_schedule, tick_times)
from jaxllm.plan.hlo import memory_summary

PRESETS = {"gpt2": "tiny-gpt2", "llama": "tiny-llama"}

LAYERS = 8  # divisible by pp·v = 4·2


# ---------------------------------------------------------------- tables


def run_table(s):
    """Execute a table symbolically: buffers hold (microbatch, global stage) keys. Returns the
    forward and backward ticks of each key, asserting every read finds what it should, every arrival
    was sent by its neighbour (or kept by its own stage) and overwrites nothing still needed."""
    p, v = s.stages, s.chunks
    last = p * v - 1
    f = {name: s.field(name) for name in FIELDS}
    acts = [[None] * s.act_depth for _ in range(p)]
    grads = [[None] * s.grad_depth for _ in range(p)]
    stash = [[None] * max(s.stash_depth, 1) for _ in range(p)]
    fwd, rec, bwd, wgt, pieces = {}, {}, {}, {}, {}
    residuals = [None] * p
    for t in range(s.ticks):
        out, back = [None] * p, [None] * p
        for st in range(p):
            i, c = f["r_mb"][t, st], f["r_chunk"][t, st]
            if i >= 0:  # R: the chunk re-run from its saved input; one set of residuals kept per stage
                g = s.global_stage(st, c)
                assert (i, g) not in rec and fwd[(i, g)] < t and residuals[st] is None
                if g > 0:
                    assert acts[st][f["r_slot"][t, st]] == (i, g)
                rec[(i, g)], residuals[st] = t, (i, g)
            i, c = f["fwd_mb"][t, st], f["fwd_chunk"][t, st]
            if i >= 0:
                g = s.global_stage(st, c)
                assert (i, g) not in fwd
                if g > 0:
                    assert acts[st][f["fwd_slot"][t, st]] == (i, g)
                fwd[(i, g)] = t
                out[st] = (i, g + 1) if g < last else None
            i, c = f["bwd_mb"][t, st], f["bwd_chunk"][t, st]
            if i >= 0:
                g = s.global_stage(st, c)
                assert (i, g) not in bwd and fwd.get((i, g), t + 1) <= t
                if s.split:  # B pulls back from R's residuals
                    assert residuals[st] == (i, g) and rec[(i, g)] < t
                    residuals[st] = None
                elif g > 0:
                    assert acts[st][f["bwd_slot"][t, st]] == (i, g)
                if g < last:
                    assert grads[st][f["bwd_grad_slot"][t, st]] == (i, g)
                bwd[(i, g)] = t
                back[st] = (i, g - 1) if g > 0 else None
                if s.split:
                    assert stash[st][f["stash_slot"][t, st]] in wgt or stash[st][f["stash_slot"][t, st]] is None
                    stash[st][f["stash_slot"][t, st]] = (i, g)
            for w in ("w", "w2"):  # W in pieces, in order, from the stash B left, in up to two slots a tick
                i, c = f[w + "_mb"][t, st], f[w + "_chunk"][t, st]
                if i >= 0:
                    g = s.global_stage(st, c)
                    assert bwd[(i, g)] < t and stash[st][f[w + "_slot"][t, st]] == (i, g) and (i, g) not in wgt
                    assert f[w + "_first"][t, st] == pieces.get((i, g), 0) and f[w + "_count"][t, st] > 0
                    pieces[(i, g)] = f[w + "_first"][t, st] + f[w + "_count"][t, st]
                    assert pieces[(i, g)] <= s.pieces
                    if pieces[(i, g)] == s.pieces:
                        wgt[(i, g)] = t
        for st in range(p):  # the exchange at the end of the tick
            for side, src in (("below", st - 1), ("above", st + 1), ("self", st)):
                kind, slot = f[side + "_kind"][t, st], f[side + "_slot"][t, st]
                if kind == NOTHING:
                    continue
                if side != "self":
                    assert s.ring or 0 <= src < p
                    src %= p
                    assert f["send_up" if side == "below" else "send_down"][t, src] == kind
                sent = {OUTPUT: out[src], GRADIENT: back[src]}[kind]
                buffer = (acts if kind == OUTPUT else grads)[st]
                assert sent is not None and (buffer[slot] is None or buffer[slot] in (rec if s.split and kind == OUTPUT
                                                                                      else bwd))
                buffer[slot] = sent
    keys = {(i, g) for i in range(s.microbatches) for g in range(p * v)}
    assert set(fwd) == keys and set(bwd) == keys
    assert set(wgt) == set(rec) == (keys if s.split else set())
    sends = sum(int((s.field(d) != NOTHING).sum()) for d in ("send_up", "send_down"))
    arrivals = sum(int((s.field(side + "_kind") != NOTHING).sum()) for side in ("below", "above"))
    assert sends == arrivals  # nothing sent is lost
    return fwd, bwd


TABLES = ([(name, p, m, 1) for name in ("gpipe", "1f1b") for p in (2, 4, 8) for m in (8, 16, 32)]
          + [("gpipe", 4, 2, 1), ("1f1b", 4, 4, 1)]
          + [("interleaved", p, m, v) for p in (2, 4) for m in (4, 8, 16) for v in (2, 3)])


@pytest.mark.parametrize("name,p,m,v", TABLES)
def test_table_runs_and_its_bubble_is_the_formula(name, p, m, v):
    s = make_schedule(name, p, m, v)
    fwd, bwd = run_table(s)
    for (i, g), t in fwd.items():  # a stage's input is one tick behind its upstream neighbour
        assert g == 0 or fwd[(i, g - 1)] < t
    for (i, g), t in bwd.items():
        assert g == p * v - 1 or bwd[(i, g + 1)] < t
    expected = (p - 1) / (m + p - 1) if v == 1 else (p - 1) / (v * m + p - 1)
    assert bubble_formula(s) == pytest.approx(expected)
    for costs in [Costs(), Costs(1.0, 1.0, 0.5, 0.5), Costs(1.0, 0.5, 1.0, 2.0)]:  # a fused backward: R + B + W
        assert bubble_fraction(s, costs) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 16, 32, 64])
def test_1f1b_keeps_at_most_2p_minus_1_inputs_and_gpipe_keeps_m(p, m):
    one, gpipe = make_schedule("1f1b", p, m), make_schedule("gpipe", p, m)
    assert one.act_depth <= 2 * p - 1
    assert gpipe.act_depth == m
    # Stage 0 reads tokens, so the deepest buffer is stage 1's: its input waits 2(p−1)−1 ticks for
    # its backward, whatever m is. 1F1B takes fewer ticks (its steady ticks do both kinds of work).
    assert one.act_depth == min(m, 2 * p - 3)
    assert one.ticks == m + 2 * (p - 1) and gpipe.ticks == 2 * (m + p - 1) - 1
    assert tick_times(one).sum() == pytest.approx(tick_times(gpipe).sum())


BAD = {
    "layers": ({"mesh.pp": 4, "model.n_layers": 6}, "model.n_layers"),
    "zb_v_layers": ({"mesh.pp": 4, "model.n_layers": 4, "train.pp_schedule": "zb_v"}, "2×mesh.pp"),
    "zb_h1_few_microbatches": ({"mesh.pp": 4, "train.microbatches": 2, "train.pp_schedule": "zb_h1"},
                               "train.microbatches=2"),
    "layers_virtual": ({"mesh.pp": 2, "train.pp_schedule": "interleaved", "train.pp_virtual": 3,
                        "train.microbatches": 4}, "pp_virtual"),
    "1f1b_few_microbatches": ({"mesh.pp": 4, "train.microbatches": 2}, "train.microbatches=2"),
    "interleaved_groups": ({"mesh.pp": 2, "train.pp_schedule": "interleaved", "train.pp_virtual": 2,
                            "train.microbatches": 3, "train.global_batch": 6}, "multiple of 2"),
    "virtual_without_interleaving": ({"mesh.pp": 2, "train.pp_virtual": 2, "train.microbatches": 4},
                                     "interleaved"),
    "virtual_without_pp": ({"train.pp_virtual": 2}, "mesh.pp"),
    "unknown_schedule": ({"mesh.pp": 2, "train.pp_schedule": "zigzag"}, "train.pp_schedule"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_pipeline_configs_are_one_line_errors(case):
    over, needle = BAD[case]
    cfg = build_config(None, {"model.preset": "tiny-gpt2", "model.vocab_size": 257, "model.n_layers": 8, "mesh.dp": -1,
                             **over})
    with pytest.raises(ConfigError) as e:
        validate(cfg, 8)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the executor


def config(family: str, **over):
    """The equivalence config with 8 layers (divisible by pp·v = 4·2)."""
    return equivalence_config(PRESETS[family], **{"model.n_layers": LAYERS, **over})


def pipeline_fns(family: str, **over):
    return step_fns(config(family, **over))


def assert_matches_the_reference(family: str, **over):
    ref = reference(config(family).model)
    loss, grads = loss_and_grads(pipeline_fns(family, **over), ref[0])
    assert_matches(loss, grads, ref)


# The tied GPT-2 embeddings (used on the first and the last stage) are the harder case, so gpt2 covers
# every pair of (schedule, pp, microbatches) and llama (untied head, grouped-query attention) two more.
# (The tables themselves run symbolically above for many more shapes.)
SCHEDULE_CASES = [("gpt2", "gpipe", 2, 4), ("gpt2", "gpipe", 4, 8), ("gpt2", "1f1b", 2, 8), ("gpt2", "1f1b", 4, 4),
                  ("llama", "gpipe", 2, 4), ("llama", "1f1b", 4, 8)]


@pytest.mark.parametrize("family,schedule,pp,microbatches", tiers(SCHEDULE_CASES, {("llama", "1f1b", 4, 8)}))
def test_schedules_match_the_reference(family, schedule, pp, microbatches):
    assert_matches_the_reference(family, **{"mesh.pp": pp, "train.microbatches": microbatches,
                                         "train.pp_schedule": schedule})


@pytest.mark.parametrize("family,pp,microbatches",
                         tiers([("gpt2", 2, 4), ("gpt2", 4, 4), ("gpt2", 4, 8), ("llama", 4, 8)], {("gpt2", 4, 8)}))
def test_interleaved_matches_the_reference(family, pp, microbatches):
    assert_matches_the_reference(family, **{"mesh.pp": pp, "train.microbatches": microbatches,
                                         "train.pp_schedule": "interleaved", "train.pp_virtual": 2})


# Windows on layers 0-3 only: with pp=2 the stages' chunks (4 layers, or 2 interleaved) differ, so a chunk
# that read another's windows would be caught.
WINDOWED = {"model.sliding_window": 8, "model.window_pattern": ["local"] * 4 + ["global"] * 4}


@pytest.mark.slow
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_windows_that_differ_by_layer_travel_with_the_stages(schedule, virtual):
    """Per-layer windows are read by each chunk from its place in the stack: loss and gradients equal the same
    windowed model on one device (the plain reference has no windows)."""
    params = reference(config("llama").model)[0]  # a window changes no parameter
    loss, grads = loss_and_grads(pipeline_fns("llama", **WINDOWED), params)
    got = loss_and_grads(pipeline_fns("llama", **WINDOWED, **{"mesh.pp": 2, "train.microbatches": 4,
                                                              "train.pp_schedule": schedule,
                                                              "train.pp_virtual": virtual}), params)
    assert_matches(*got, (params, float(loss), grads))


PP_FSDP_TP = {"mesh.pp": 2, "mesh.fsdp": 2, "mesh.tp": 2}
# ZeRO-0 and ZeRO-1 share one gradient program (the batch axes manual in the island, one reduction at the
# end; they differ only in the optimizer state's layout, which the whole-step test below covers).
MESHES_3D = {  # name -> (axes and options, ZeRO stage, families)
    "pp2_fsdp2_tp2_zero0": (PP_FSDP_TP, 0, ("gpt2",)),
    "pp2_fsdp2_tp2_zero2": (PP_FSDP_TP, 2, ("llama",)),
    "pp2_fsdp2_tp2_zero3": (PP_FSDP_TP, 3, ("gpt2", "llama")),
    "pp2_fsdp2_tp2_zero3_gather_once": ({**PP_FSDP_TP, "train.pp_gather_once": True}, 3, ("llama",)),
    "pp2_fsdp2_tp2_zero3_sequence_parallel": ({**PP_FSDP_TP, "train.sequence_parallel": True}, 3, ("gpt2",)),
    "pp2_dp2_tp2_interleaved": ({"mesh.pp": 2, "mesh.dp": 2, "mesh.tp": 2, "train.pp_schedule": "interleaved",
                                 "train.pp_virtual": 2}, 1, ("gpt2",)),
}


@pytest.mark.parametrize("mesh,family", tiers([(mesh, f) for mesh, (_, _, fams) in MESHES_3D.items() for f in fams],
                                              {("pp2_fsdp2_tp2_zero3", "llama")}))
def test_3d_parallel_matches_the_reference(mesh, family):
    axes, stage, _ = MESHES_3D[mesh]
    assert_matches_the_reference(family, **axes, **{"train.zero_stage": stage, "train.microbatches": 4})


# Islands inside the stages (context parallelism over sp, collective matmuls over tp): every stage runs its chunk
# at every tick (`pipeline.islands_inside`), under each schedule and attention strategy.
ISLANDS_INSIDE = {  # name -> (axes and options, families)
    "pp2_sp2_dp2_1f1b_ring": ({"mesh.pp": 2, "mesh.sp": 2, "mesh.dp": 2}, ("llama", "gpt2")),
    "pp2_sp2_tp2_zero1_ring_zigzag": ({"mesh.pp": 2, "mesh.sp": 2, "mesh.tp": 2, "train.sequence_parallel": True,
                                       "train.zero_stage": 1, "model.cp_load_balance": True}, ("llama",)),
    "pp2_sp2_fsdp2_zero3_ulysses_interleaved": ({"mesh.pp": 2, "mesh.sp": 2, "mesh.fsdp": 2, "train.zero_stage": 3,
                                                 "model.cp_strategy": "ulysses", "train.pp_schedule": "interleaved",
                                                 "train.pp_virtual": 2}, ("llama",)),
    "pp2_sp4_gpipe_allgather": ({"mesh.pp": 2, "mesh.sp": 4, "train.pp_schedule": "gpipe",
                                 "model.cp_strategy": "allgather"}, ("gpt2",)),
    "pp2_sp2_tp2_zero3_zb_v_zigzag": ({"mesh.pp": 2, "mesh.sp": 2, "mesh.tp": 2, "train.sequence_parallel": True,
                                       "train.zero_stage": 3, "train.pp_schedule": "zb_v",
                                       "model.cp_load_balance": True}, ("llama",)),
    "pp2_sp2_fsdp2_zero3_zb_h1_ulysses": ({"mesh.pp": 2, "mesh.sp": 2, "mesh.fsdp": 2, "train.zero_stage": 3,
                                           "train.pp_schedule": "zb_h1", "model.cp_strategy": "ulysses"}, ("gpt2",)),
    "pp2_tp2_dp2_collective_matmul": ({"mesh.pp": 2, "mesh.tp": 2, "mesh.dp": 2, "train.sequence_parallel": True,
                                       "model.collective_matmul": True}, ("llama",)),
    "pp2_sp2_tp2_zero1_collective_matmul": ({"mesh.pp": 2, "mesh.sp": 2, "mesh.tp": 2, "train.sequence_parallel": True,
                                             "train.zero_stage": 1, "model.collective_matmul": True}, ("llama",)),
}


@pytest.mark.parametrize("mesh,family", tiers([(m, f) for m, (_, fams) in ISLANDS_INSIDE.items() for f in fams],
                                              {("pp2_sp2_dp2_1f1b_ring", "llama")}))
def test_islands_inside_the_stages_match_the_reference(mesh, family):
    axes, _ = ISLANDS_INSIDE[mesh]
    assert_matches_the_reference(family, **{"train.microbatches": 4, **axes})


# remat policies and the chunked loss inside pipeline stages
STAGE_OPTIONS = {
    "gpt2_full_remat_chunked_loss_pp2_dp2_tp2": ("gpt2", {"mesh.pp": 2, "mesh.dp": 2, "mesh.tp": 2,
                                                           "train.zero_stage": 1, "model.remat": "full",
                                                           "train.loss_chunk": 8}),
    "llama_save_named_pp2_fsdp4_zero3": ("llama", {"mesh.pp": 2, "mesh.fsdp": 4, "train.zero_stage": 3,
                                                   "model.remat": "save-named"}),
    "llama_save_dots_chunked_loss_pp4_dp2": ("llama", {"mesh.pp": 4, "mesh.dp": 2, "model.remat": "save-dots",
                                                       "train.loss_chunk": 16}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGE_OPTIONS)
def test_remat_and_chunked_loss_in_stages_match_the_reference(name):
    family, over = STAGE_OPTIONS[name]
    assert_matches_the_reference(family, **over, **{"train.microbatches": 4})


@pytest.mark.slow
def test_pipelined_train_step_matches_one_device_step():
    """A whole step (clipping, AdamW, ZeRO-1 sharded update) on pp2×dp2×tp2 equals the one-device step."""
    over = {"train.zero_stage": 1, "train.microbatches": 4}
    one = pipeline_fns("llama", **over)
    fns = pipeline_fns("llama", **{"mesh.pp": 2, "mesh.dp": 2, "mesh.tp": 2}, **over)
    state0 = jax.device_get(one.init(0))
    new_one, m_one = train_step(one, state0)
    new, m = train_step(fns, state0)
    assert float(m["loss"]) == pytest.approx(float(m_one["loss"]), rel=LOSS_RTOL)
    assert float(m["grad_norm"]) == pytest.approx(float(m_one["grad_norm"]), rel=GRAD_RTOL)
    delta = lambda a, b: jax.tree.map(lambda x, y: np.asarray(x) - np.asarray(y), a, b)
    assert max_rel_err(delta(new.params, state0.params), delta(new_one.params, state0.params)) <= GRAD_RTOL


# ---------------------------------------------------------------- compiled programs

MEMORY = {"model.seq_len": 64, "train.global_batch": 64, "train.microbatches": 8, "mesh.pp": 2}


def compiled(fns, batch: int, seq: int):
    return lower_loss_and_grads(fns, batch, seq).compile()


@pytest.mark.slow
def test_1f1b_temporaries_stay_flat_in_microbatches_and_below_gpipe():
    """p=2, 8 rows per microbatch. From m=8 to m=16 GPipe keeps 8 more stage inputs and its compiled
    temporaries grow by at least those slots; 1F1B's buffers do not depend on m and its temporaries
    grow by less than one slot. At m=8 GPipe's are above 1F1B's by at least the 7 slots the tables save."""
    rows, seq = 8, MEMORY["model.seq_len"]
    temps = {}
    for name in ("gpipe", "1f1b"):
        for m in (8, 16):
            fns = pipeline_fns("gpt2", **{**MEMORY, "train.microbatches": m, "train.global_batch": rows * m,
                                          "train.pp_schedule": name})
            temps[name, m] = memory_summary(compiled(fns, rows * m, seq))["temp_bytes"]
    slot = rows * seq * config("gpt2").model.d_model * 4  # one microbatch's [rows, seq, d_model] fp32 input
    depth = lambda name, m: make_schedule(name, 2, m).act_depth
    assert (depth("gpipe", 16) - depth("gpipe", 8), depth("1f1b", 16) - depth("1f1b", 8)) == (8, 0)
    assert temps["gpipe", 16] - temps["gpipe", 8] >= 8 * slot, temps
    assert abs(temps["1f1b", 16] - temps["1f1b", 8]) < slot, temps
    assert temps["gpipe", 8] - temps["1f1b", 8] >= (depth("gpipe", 8) - depth("1f1b", 8)) * slot, temps


def weight_gathers_in_loop(hlo: str, shapes: set) -> int:
    """All-gathers inside the tick loop whose result has the full shape of one layer's weight (or of a
    shared weight): the per-microbatch ZeRO-3 gathers."""
    n = 0
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\][^ ]* all-gather\(", line)
        if m and "/while/body/" in line:
            n += tuple(int(d) for d in m.group(1).split(",") if d) in shapes
    return n


@pytest.mark.slow
def test_zero3_gather_once_takes_weight_gathers_out_of_the_loop():
    over = {"mesh.pp": 2, "mesh.fsdp": 4, "train.zero_stage": 3, "train.microbatches": 4}
    m = config("llama").model
    table = transformer.param_table(m)
    is_leaf = lambda x: isinstance(x, transformer.Leaf)
    shapes = {l.shape[1:] for l in jax.tree.leaves(table["blocks"], is_leaf=is_leaf)}
    shapes |= {l.shape for k, sub in table.items() if k != "blocks" for l in jax.tree.leaves(sub, is_leaf=is_leaf)}
    per_microbatch = weight_gathers_in_loop(compiled(pipeline_fns("llama", **over), 16, 32).as_text(), shapes)
    once = weight_gathers_in_loop(
        compiled(pipeline_fns("llama", **over, **{"train.pp_gather_once": True}), 16, 32).as_text(), shapes)
    assert per_microbatch > 0 and once == 0, (per_microbatch, once)
