"""Zero-bubble pipelines (ZB-H1, ZB-V): the split backward, its tables, equivalence, costs and memory.

Tables (no JAX): each runs symbolically (`test_pipeline.run_table`: every F, B and W once, every read finds
what it should, W after its B from the stash slot B filled); at unit costs (F = B = W) the step's bubble is
the closed form and the idle time inside a stage's span is the paper's (p−1)(T_F+T_B−T_W) for ZB-H1 and
(p−1)(T_F+T_B−2T_W) = 0 for ZB-V but where docs/pipeline.md lists it otherwise, over every p ≤ 8 and m ≤ 24. Executor (8 fake CPU devices, fp32): one step's loss and gradients equal
the independent reference for both schedules on pp2×dp4, pp4×dp2 and pp2×fsdp2×tp2 with 4 microbatches and
on pp4×dp2 with 8. Compiled programs: B and W together cost what the fused backward costs, B alone
less (it makes no weight gradient) and W no more than a forward (it recomputes nothing); temporaries stay
within 1F1B's plus the W stash `jaxllm plan` predicts. (The one-line refusals are in test_pipeline.py's BAD.)
"""

import re
from fractions import Fraction

import jax
import pytest

from harness import REPO, assert_matches, equivalence_config, loss_and_grads, reference, step_fns, tiers
from jaxllm.plan.hlo import memory_summary
from jaxllm.plan.pipeline import pipeline_theory
from jaxllm.parallel.pipeline_schedules import Costs, bubble_formula, bubble_fraction, idle_in_span, make_schedule
from test_pipeline import compiled, run_table

PRESETS = {"gpt2": "tiny-gpt2", "llama": "tiny-llama"}
TABLES = ([("zb_h1", p, m) for p, m in ((2, 4), (2, 8), (4, 4), (4, 8), (8, 16))]
          + [("zb_v", p, m) for p, m in ((2, 4), (2, 8), (4, 8), (8, 16))])


@pytest.mark.parametrize("name,p,m", TABLES)
def test_tables_run_and_their_bubbles_are_the_papers(name, p, m):
    second_slot = []
    for pieces in (2, 4):  # built for a transformer's costs, W in pieces (one per layer), in up to two slots a tick
        built = make_schedule(name, p, m, costs=Costs(1, 0.76, 1.12, 0.88), pieces=pieces)
        run_table(built)  # every W piece once, in order, after its B, from its stash
        second_slot.append((built.field("w2_count") > 0).any())
    assert any(second_slot)
    s = make_schedule(name, p, m)
    run_table(s)
    assert s.split and s.chunks == (2 if name == "zb_v" else 1)
    assert bubble_fraction(s) == pytest.approx(bubble_formula(s), abs=1e-12)
    assert bubble_formula(s) == pytest.approx((p - 1) / ((8 if name == "zb_v" else 4) * m + p - 1))
    idle = idle_in_span(s)  # unit costs: F = R = B = W = 1 per microbatch and stage (1/2 per chunk in the V)
    assert idle.max() == pytest.approx(p - 1 if name == "zb_h1" else 0.0)
    # stage inputs held: at most 1F1B's in-flight count (p; the V's inputs are chunk inputs, one more per chunk)
    assert s.act_depth <= (p if name == "zb_h1" else 2 * p + 1)


def _documented_exceptions() -> dict:
    """docs/pipeline.md's table of the (p, m) where ZB-V idles inside a span: (idle per stage, ticks, bubble)."""
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.· ]+) \| (\d+) \([+-]\d+\) \| (\d+)/(\d+) \|$",
                      (REPO / "docs" / "pipeline.md").read_text(), re.M)
    return {(int(p), int(m)): ([float(x) for x in idle.split(" · ")], int(ticks), Fraction(int(a), int(b)))
            for p, m, idle, ticks, a, b in rows}


def test_every_table_up_to_8_stages_and_24_microbatches_has_the_bubble_the_docs_give():
    """At unit costs, over p = 2…8: ZB-H1 for m = p…24 idles p−1−s ticks in stage s's span and its step's bubble
    is (p−1)/(4m+p−1); ZB-V for m = 2p−1…24 idles nowhere in a span with bubble (p−1)/(8m+p−1), or exactly as the
    docs' table lists it."""
    listed = _documented_exceptions()
    assert len(listed) == 26
    for p in range(2, 9):
        for m in range(p, 25):
            s = make_schedule("zb_h1", p, m)
            assert idle_in_span(s).tolist() == [p - 1 - stage for stage in range(p)], (p, m)
            assert bubble_fraction(s) == pytest.approx(Fraction(p - 1, 4 * m + p - 1)), (p, m)
        for m in range(2 * p - 1, 25):
            s = make_schedule("zb_v", p, m)
            idle, ticks, bubble = listed.pop((p, m), ([0.0] * p, 8 * m + p - 1, Fraction(p - 1, 8 * m + p - 1)))
            assert (idle_in_span(s).tolist(), s.ticks) == (idle, ticks), (p, m)
            assert Fraction(s.ticks - 8 * m, s.ticks) == bubble and bubble_fraction(s) == pytest.approx(bubble), (p, m)
            assert s.act_depth <= 2 * p + 1, (p, m)
    assert not listed, f"pairs the docs list but no table has: {sorted(listed)}"


def config(family: str, **over):
    return equivalence_config(PRESETS[family], **{"model.n_layers": 8, **over})


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb_h1", "zb_v"])
def test_fp8_weight_gradients_made_in_w_are_the_fused_backwards(schedule):
    """With precision.matmul = "fp8" W quantizes its stash as the fused backward quantizes the projection's input
    and output gradient (E4M3 and E5M2, each scaled by its tensor's amax): one step equals 1F1B's in fp8 on the same
    pp2 × dp2 (a run equals one device in fp8 only with one microbatch, so 1F1B is the peer). Attention's weights
    come out bitwise equal; the MLP's gate and up weights 3.3e-5 apart (measured), their input having passed
    through fp8 attention in two programs that round it differently by ~1e-7, which moves a few elements to the
    neighbouring E4M3 value: within the equivalence contract's 1e-4."""
    over = {"precision.matmul": "fp8", "mesh.pp": 2, "mesh.dp": 2, "train.microbatches": 4}
    fused = step_fns(config("llama", **over, **{"train.pp_schedule": "1f1b"}))
    params = jax.device_get(fused.init(0).params)
    loss, grads = loss_and_grads(fused, params)
    split = step_fns(config("llama", **over, **{"train.pp_schedule": schedule}))
    assert_matches(*loss_and_grads(split, params), (params, float(loss), jax.device_get(grads)))


PP_FSDP_TP = {"mesh.pp": 2, "mesh.fsdp": 2, "mesh.tp": 2}
CASES = {  # name -> (schedule, family, axes and options); both schedules on every mesh of the issue
    "zb_h1_pp2_dp4": ("zb_h1", "llama", {"mesh.pp": 2, "mesh.dp": 4}),
    "zb_v_pp2_dp4": ("zb_v", "gpt2", {"mesh.pp": 2, "mesh.dp": 4}),
    "zb_h1_pp4_dp2": ("zb_h1", "gpt2", {"mesh.pp": 4, "mesh.dp": 2}),
    "zb_v_pp4_dp2": ("zb_v", "llama", {"mesh.pp": 4, "mesh.dp": 2}),
    "zb_h1_pp2_fsdp2_tp2_zero3": ("zb_h1", "llama", {**PP_FSDP_TP, "train.zero_stage": 3}),
    "zb_v_pp2_fsdp2_tp2_zero1": ("zb_v", "gpt2", {**PP_FSDP_TP, "train.zero_stage": 1}),
    "zb_h1_pp4_dp2_m8": ("zb_h1", "llama", {"mesh.pp": 4, "mesh.dp": 2, "train.microbatches": 8}),
    "zb_v_pp4_dp2_m8": ("zb_v", "gpt2", {"mesh.pp": 4, "mesh.dp": 2, "train.microbatches": 8}),
}


@pytest.mark.parametrize("case", tiers(list(CASES), {"zb_v_pp4_dp2_m8"}))
def test_zero_bubble_matches_the_reference(case):
    schedule, family, over = CASES[case]
    ref = reference(config(family).model)
    fns = step_fns(config(family, **{"train.microbatches": 4, **over, "train.pp_schedule": schedule}))
    assert_matches(*loss_and_grads(fns, ref[0]), ref)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_split_backward_costs_and_what_they_give(preset):
    """One layer compiled: R and B have none of the weight-gradient matmuls the fused backward has, W one per
    tapped weight (attention's four, the MLP's two or three); by XLA's flop counts R, B and W together do the
    fused backward's work and W recomputes nothing. With tables built for these costs, at pp4 and m = 8 with
    four layers a stage (W in four pieces), ZB-H1 and ZB-V take less time than interleaved 1F1B (v = 2) with a
    smaller bubble; ZB-H1 owes that to the pieces (W whole, one operation a tick, it does not)."""
    from tools.studies.pipeline import compare, compiled_costs

    c = compiled_costs(preset)
    dots, costs = c["weight_dots"], c["costs"]
    assert dots["forward"] == dots["recompute"] == dots["backward"] == 0 < dots["fused"], dots
    assert dots["weight"] == (6 if preset == "tiny-gpt2" else 7), dots
    assert costs.recompute + costs.backward + costs.weight == pytest.approx(c["fused"], rel=0.05), c
    assert 0.3 < costs.weight < c["fused"] - costs.recompute, c
    whole, pieces = compare(4, 8, costs), compare(4, 8, costs, layers=16)  # 4 layers a stage: W in 4 pieces
    for fast, slow in (("zb_v", "interleaved"), ("zb_h1", "interleaved"), ("zb_h1", "1f1b")):
        assert pieces[fast]["time"] < pieces[slow]["time"] and pieces[fast]["bubble"] < pieces[slow]["bubble"], (
            costs, pieces)
    assert pieces["zb_h1"]["time"] < whole["zb_h1"]["time"], (whole, pieces)  # W's pieces fill the ticks


def test_r_keeps_what_its_weights_cannot_give_again():
    """R's residuals split by dependence (`pipeline._given_by`): what depends on the weights alone (here their
    bf16 casts inside a scan over layers) is made again from the weights, equal to what the pullback held; what
    depends on the input is kept."""
    import jax
    import jax.numpy as jnp

    from jaxllm.parallel.pipeline import _given_by

    def layers(w, x):
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl.astype(jnp.bfloat16)), None), x, w)[0]

    residuals = lambda w, x: jax.tree.leaves(jax.vjp(layers, w, x)[1])
    w, x = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4)), jnp.ones((2, 4), jnp.bfloat16)
    rebuilt, rebuild, shapes = _given_by(residuals, w, x)
    held = residuals(w, x)
    assert [a.shape for a in held] == [s.shape for s in shapes] and 0 < sum(rebuilt) < len(held), rebuilt
    again = iter(rebuild(w))
    for a, is_rebuilt in zip(held, rebuilt):
        assert is_rebuilt == (a.shape == w.shape)  # the casts of the weights, nothing that saw x
        if is_rebuilt:
            assert (next(again) == a).all()
    assert next(again, None) is None


MEMORY = {"model.seq_len": 64, "train.global_batch": 64, "train.microbatches": 8, "mesh.pp": 2}


@pytest.mark.slow
def test_activation_memory_is_1f1b_plus_the_predicted_stash():
    temps = {}
    for name in ("1f1b", "zb_h1", "zb_v"):
        cfg = config("llama", **MEMORY, **{"train.pp_schedule": name})
        temps[name] = memory_summary(compiled(step_fns(cfg), 64, 64))["temp_bytes"]
        if name != "1f1b":
            shape = {**dict.fromkeys(("dp", "fsdp", "ep", "tp", "sp"), 1), "pp": 2}
            plan = pipeline_theory(cfg.model, cfg.train, shape, "float32")
            assert temps[name] <= temps["1f1b"] + plan["stash_bytes"], (name, temps, plan["stash_bytes"])
            # and the stash is really there: more than its slots above 1F1B's
            assert temps[name] - temps["1f1b"] >= (plan["stash_depth"] - 2) * plan["stash_slot_bytes"], temps
