"""tools.plan: compiled memory follows the ZeRO table, collectives are per step, the CLI contract,
the tensor-parallel theory (collectives per layer, saved activations) against a compiled step,
and the attention memory per layer under context parallelism (pure arithmetic, no compiling).

Runs on the 8 fake CPU devices of conftest.py. Each compile takes a few seconds, so the
in-process plans are cached per (stage, microbatches) for the module.
"""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from jaxllm.config import build_config, validate
from jaxllm.errors import ConfigError
from jaxllm.models import transformer
from tools.collectives import KINDS
from tools.plan import (_format_attention, attention_memory_theory, format_table, permute_dtypes, pipeline_theory,
                        plan, stage_params, tensor_parallel_theory, theory)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Parameters dominate the compiled arguments: ~3.3M fp32 params (~13 MiB per copy) against
# an int32 batch of 16 x 33 tokens. vocab_size=0: the byte tokenizer's 257, padded to 384.
SMALL = ["model.family=gpt2", "model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
         "model.seq_len=32", "model.vocab_size=0", "train.global_batch=16", "precision.compute=float32",
         "mesh.fsdp=8", "mesh.dp=1"]
N = 8


@pytest.fixture(scope="module")
def plans():
    cache = {}

    def get(stage: int, microbatches: int = 1) -> dict:
        key = (stage, microbatches)
        if key not in cache:
            cfg = build_config(None, SMALL + [f"train.zero_stage={stage}", f"train.microbatches={microbatches}"])
            cache[key] = plan(cfg)
            assert cfg.model.vocab_size == 0, "plan() must not modify the caller's config"
        return cache[key]

    return get


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, "-m", "tools.plan", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_theory_formulas():
    phi, n = 1000, 8
    t = theory(phi, n, 2)
    assert [t["fp32"]["stages"][s]["total_bytes"] for s in "0123"] == [16000, 9000, 5500, 2000]
    assert [t["fp32"]["stages"][s]["argument_bytes"] for s in "0123"] == [12000, 5000, 5000, 1500]
    assert [t["bf16_seeds"]["stages"][s]["total_bytes"] for s in "0123"] == [16000, 5500, 3750, 2000]
    assert (t["fp32"]["total_bytes"], t["fp32"]["argument_bytes"], t["bf16_seeds"]["total_bytes"]) == (5500, 5000, 3750)
    # With N = 1 every stage is plain data parallelism.
    one = theory(phi, 1, 3)
    assert {one["fp32"]["stages"][s]["total_bytes"] for s in "0123"} == {16000}
    assert {one["bf16_seeds"]["stages"][s]["total_bytes"] for s in "0123"} == {16000}


def test_argument_bytes_follow_zero_table(plans):
    p0, p1, p3 = plans(0), plans(1), plans(3)
    phi = p0["params"]
    assert phi == transformer.count_params(build_config(None, SMALL + ["model.vocab_size=257"]).model)
    expected = {0: 12 * phi, 1: 4 * phi + 8 * phi / N, 3: 12 * phi / N}
    for stage, p in ((0, p0), (1, p1), (3, p3)):
        got = p["memory"]["argument_bytes"]
        assert abs(got - expected[stage]) <= 0.10 * expected[stage], (stage, got, expected[stage])
        assert p["theory"]["fp32"]["argument_bytes"] == pytest.approx(expected[stage], abs=1)
        assert p["config"]["zero_stage"] == stage and p["config"]["mesh"]["fsdp"] == N
        assert p["devices"] == 8
    ratio = p3["memory"]["argument_bytes"] / p0["memory"]["argument_bytes"]
    assert abs(ratio - 1 / N) <= 0.10 / N, ratio
    # Donation: the state's buffers are reused for the new state.
    for p in (p0, p1, p3):
        m = p["memory"]
        assert m["alias_bytes"] >= 0.95 * m["argument_bytes"]
        assert m["total_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
    # Stage 0 gathers nothing; ZeRO-1 gathers the updated params; ZeRO-3 gathers weights at use.
    assert p0["collectives"]["all-gather"]["count"] == 0
    assert p1["collectives"]["all-gather"]["count"] > 0
    assert p3["collectives"]["all-gather"]["count"] > 0


def test_collectives_counted_per_microbatch(plans):
    """ZeRO-3 gathers each layer's weights inside the layer scan, which runs inside the
    gradient-accumulation scan, so the compiled step runs those gathers once per microbatch.

    Inspected on this JAX/XLA (CPU): all-gather counts are 61 / 117 / 229 for 1 / 2 / 4
    microbatches, i.e. count = c + k * microbatches with k = 56 gathers per microbatch
    (the block weights, per layer-scan trip) and c = 5 gathers that XLA hoists out of the
    accumulation loop as loop-invariant (embeddings and final norm: they do not depend on
    the microbatch). So the relation is linear with slope k, and "twice" only up to c.
    The bytes per microbatch are the full (gathered) block weights, 4 bytes per parameter.
    """
    one, two = plans(3, 1), plans(3, 2)
    assert one["unknown_trip_loops"] == 0 and two["unknown_trip_loops"] == 0
    ag1, ag2 = one["collectives"]["all-gather"], two["collectives"]["all-gather"]
    k = ag2["count"] - ag1["count"]  # gathers per microbatch
    c = ag1["count"] - k  # gathers outside the accumulation loop
    assert k > 0 and 0 <= c < k / 4, (ag1, ag2)
    assert 1.75 <= ag2["count"] / ag1["count"] <= 2.0
    cfg = build_config(None, SMALL + ["model.vocab_size=257"]).model
    table = transformer.param_table(cfg)
    outside = [leaf for name in ("embed", "final_norm")
               for leaf in jax.tree.leaves(table[name], is_leaf=lambda x: isinstance(x, transformer.Leaf))]
    block_params = transformer.count_params(cfg) - sum(math.prod(leaf.shape) for leaf in outside)
    per_mb_bytes = ag2["bytes"] - ag1["bytes"]
    assert 0.9 * 4 * block_params <= per_mb_bytes <= 2.1 * 4 * block_params, (per_mb_bytes, block_params)
    # Memory of the state does not depend on microbatching.
    assert one["memory"]["argument_bytes"] == two["memory"]["argument_bytes"]


def test_cli_json_contract(tmp_path):
    empty = tmp_path / "empty.toml"  # so the tiny-llama preset is not overridden by default.toml's model keys
    empty.write_text("")
    r = cli("--config", str(empty), "model.preset=tiny-llama", "mesh.fsdp=8", "mesh.dp=1",
            "train.zero_stage=3", "train.global_batch=8", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    assert out["devices"] == 8 and out["params"] > 0
    assert out["config"]["preset"] == "tiny-llama" and out["config"]["family"] == "llama"
    assert out["config"]["zero_stage"] == 3 and out["config"]["mesh"]["fsdp"] == 8
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes"):
        assert isinstance(out["memory"][key], int) and out["memory"][key] >= 0, key
    assert out["memory"]["argument_bytes"] > 0
    assert set(out["collectives"]) == set(KINDS)
    for kind in KINDS:
        assert set(out["collectives"][kind]) == {"count", "bytes"}
        assert isinstance(out["collectives"][kind]["count"], int)
        assert isinstance(out["collectives"][kind]["bytes"], int)
    assert out["collectives"]["all-gather"]["count"] > 0
    assert out["theory"]["fp32"]["argument_bytes"] == round(12 * out["params"] / 8)
    assert set(out["theory"]["fp32"]["stages"]) == set(out["theory"]["bf16_seeds"]["stages"]) == set("0123")
    assert "memory per device" in r.stderr  # the human table goes to stderr with --json
    tp = out["tensor_parallel"]  # tp=1: the marker, no made-up collectives
    assert tp["enabled"] is False and tp["tp"] == 1
    assert all(c["forward"] == c["backward"] == [] for c in tp["collectives_per_layer"].values())
    at = out["attention"]  # sp=1: plain attention against itself
    assert at["enabled"] is False and at["sp"] == 1 and at["strategy"] == "plain" and at["ratio"] == 1
    assert at["this"] == at["sp1"] and at["sp1"]["bytes_per_layer"] == sum(at["sp1"]["terms"].values())
    assert "attention memory per layer (sp=1, plain)" in r.stderr
    pl = out["pipeline"]  # pp=1: the marker; Φ is all parameters
    assert pl["enabled"] is False and pl["pp"] == 1 and pl["params"]["stage"] == out["params"]
    assert "pipeline (pp=" not in r.stderr


def test_cli_bad_config_exits_2():
    r = cli("mesh.tp=3", timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "mesh" in lines[0], r.stderr
    assert r.stdout == ""


def test_vocab_smaller_than_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError, match="model.vocab_size=256"):
        plan(build_config(None, SMALL + ["model.vocab_size=256"]))


def test_zero1_accumulation_all_reduces_gradients_once_per_step(plans):
    """ZeRO-0/1 accumulate each device's partial gradients and all-reduce once per step
    (jaxllm/parallel/accumulation.py): more microbatches add no gradient communication."""
    one, four = plans(1, 1), plans(1, 2)
    phi = one["params"]
    assert four["collectives"]["all-reduce"]["bytes"] <= one["collectives"]["all-reduce"]["bytes"]
    assert four["collectives"]["all-reduce"]["bytes"] < 1.5 * 4 * phi  # one fp32 gradient's worth


# ---------------------------------------------------------------- tensor parallelism

TP_CONFIG = ["model.preset=tiny-llama", "model.vocab_size=257", "mesh.dp=2", "mesh.tp=4", "train.global_batch=16",
             "train.microbatches=2", "precision.compute=bfloat16"]


def tp_theory(*extra: str) -> dict:
    cfg = build_config(None, TP_CONFIG + list(extra))
    shape, _ = validate(cfg, 8)
    return tensor_parallel_theory(cfg.model, cfg.train, shape, cfg.precision.compute)


def by_kind(entries: list[dict]) -> dict:
    return {e["kind"]: (e["count"], e["bytes_per_call"], e["sent_bytes"]) for e in entries}


def test_tensor_parallel_theory_collectives():
    """tiny-llama on dp=2 × tp=4, 2 microbatches, bf16: b = 16/2/2 = 4 rows, s = 64, d = 64, E = 2."""
    th = tp_theory("train.sequence_parallel=true")
    n, b, s, d, E = 4, 4, 64, 64, 2
    full, shard = b * s * d * E, b * s // n * d * E
    assert (th["enabled"], th["tp"], th["setting"], th["b"], th["s"], th["d"], th["dtype_bytes"]) == (
        True, n, "sp", b, s, d, E)
    c = th["collectives_per_layer"]
    # Megatron, TP alone: 2 all-reduces of [b, s, d] each way; a ring all-reduce sends 2(n-1)/n of it
    assert by_kind(c["tp"]["forward"]) == by_kind(c["tp"]["backward"]) == {
        "all-reduce": (2, full, 2 * 2 * (n - 1) * full // n)}
    # sequence parallelism: all-gathers in (full result), reduce-scatters out (shard result), (n-1)/n sent
    assert by_kind(c["sp"]["forward"]) == by_kind(c["sp"]["backward"]) == {
        "all-gather": (2, full, 2 * (n - 1) * full // n), "reduce-scatter": (2, shard, 2 * (n - 1) * full // n)}
    # collective matmul: 4 calls x 2(n-1) permutes of half a sequence block each way
    half = b * (s // n // 2) * d * E
    assert by_kind(c["sp_cm"]["forward"]) == by_kind(c["sp_cm"]["backward"]) == {
        "collective-permute": (4 * 2 * (n - 1), half, 4 * 2 * (n - 1) * half)}
    # all three move the same bytes over the links per layer
    sent = {k: sum(v["sent_bytes"] for v in c[k]["per_layer"].values()) for k in c}
    assert set(sent.values()) == {8 * (n - 1) * full // n}, sent
    # per step: n_layers (2) x microbatches (2)
    assert c["sp_cm"]["per_step"]["collective-permute"]["count"] == 2 * 2 * 2 * 4 * 2 * (n - 1)
    assert c["sp"]["per_step"]["all-gather"]["bytes"] == 2 * 2 * 4 * full

    # an odd sequence block (s/tp = 3) travels as one ring: n-1 permutes per call of the whole block
    odd = tp_theory("model.seq_len=12", "train.sequence_parallel=true", "model.collective_matmul=true")
    assert odd["setting"] == "sp_cm"
    assert by_kind(odd["collectives_per_layer"]["sp_cm"]["forward"]) == {
        "collective-permute": (4 * (n - 1), b * 3 * d * E, 4 * (n - 1) * b * 3 * d * E)}

    # tp = 1: the marker, no numbers
    one = tp_theory("mesh.tp=1", "mesh.dp=8")
    assert one["enabled"] is False and one["tp"] == 1 and "no tensor parallelism" in one["note"]
    for setting in one["collectives_per_layer"].values():
        assert setting["forward"] == setting["backward"] == [] and setting["per_layer"] == setting["per_step"] == {}


def test_tensor_parallel_theory_activations():
    """Saved activations per layer: SP divides only the residual-region tensors (the two norm inputs) by tp."""
    th = tp_theory()
    n, b, s, d, E, H, KV, F, L = 4, 4, 64, 64, 2, 8, 4, 128, 2
    dh = d // H
    a = th["activation_bytes_per_layer"]
    residual = 2 * b * s * d * E
    expected = (residual + 2 * b * s * d * E + b * s * (H + 2 * max(KV, n)) * dh * E // n
                + b * H * s * s * (4 + E) // n + b * s * d * E // n + 3 * b * s * F * E // n)
    assert a["without_sp"] == expected
    assert a["with_sp"] < a["without_sp"]
    assert a["sp_saving"] == a["without_sp"] - a["with_sp"] == residual - residual // n
    assert th["activation_bytes"] == {k: L * a[k] for k in ("without_sp", "with_sp", "sp_saving")}
    # KV heads fewer than tp are repeated up to tp: at tp=8 each rank holds one KV head of k and v
    t8 = tp_theory("mesh.tp=8", "mesh.dp=1", "train.global_batch=8")["activation_bytes_per_layer"]["terms"]["qkv"]
    assert t8["without_sp"] == 4 * s * (H + 2 * 8) * dh * E // 8
    # gpt2 keeps two MLP hidden tensors (before and after GELU); fp32 has no second copy of the probabilities
    g = tp_theory("model.preset=tiny-gpt2", "precision.compute=float32")["activation_bytes_per_layer"]["terms"]
    assert g["mlp_hidden"]["without_sp"] == 2 * b * s * 256 * 4 // n
    assert g["attention_probs"]["without_sp"] == b * H * s * s * 4 // n


def test_collective_matmul_permutes_match_theory():
    """The compiled step of SP + collective matmuls holds exactly the theory's collective-permutes:
    per layer forward + backward, times the layers, in count and in bytes (nothing else permutes).

    Inspected on this JAX/XLA (CPU): 24 f32[8,4,64] permutes in the body of the forward layer scan
    and 24 in the backward one (2 trips each), i.e. 4 calls x 2 directions x (tp-1) each way."""
    cfg = build_config(None, ["model.preset=tiny-gpt2", "model.vocab_size=257", "model.seq_len=32", "mesh.dp=2",
                              "mesh.tp=4", "train.global_batch=16", "precision.compute=float32",
                              "train.sequence_parallel=true", "model.collective_matmul=true"])
    p = plan(cfg)
    th = p["tensor_parallel"]
    assert th["setting"] == "sp_cm" and th["b"] == 8 and th["s"] == 32
    layer = th["collectives_per_layer"]["sp_cm"]
    count = sum(e["count"] for e in layer["forward"] + layer["backward"])
    size = sum(e["bytes"] for e in layer["forward"] + layer["backward"])
    assert count == 4 * 2 * 3 * 2 and size == count * 8 * 4 * 64 * 4
    compiled = p["collectives"]["collective-permute"]
    assert p["unknown_trip_loops"] == 0
    assert compiled == {"count": count * p["config"]["n_layers"], "bytes": size * p["config"]["n_layers"]}
    assert compiled == {k: layer["per_step"]["collective-permute"][k] for k in ("count", "bytes")}
    table = format_table(p)
    assert "tensor parallelism (tp=4)" in table and "*sp_cm" in table and "with SP*" in table


# ---------------------------------------------------------------- attention memory (context parallelism)

CP_CONFIG = ["model.preset=tiny-llama", "model.vocab_size=257", "model.seq_len=4096", "mesh.dp=-1",
             "train.global_batch=8", "precision.compute=float32"]


def attention_theory(sp: int, strategy: str = "ring", *extra: str) -> dict:
    cfg = build_config(None, CP_CONFIG + [f"mesh.sp={sp}", f"model.cp_strategy={strategy}", *extra])
    shape, _ = validate(cfg, 8)
    return attention_memory_theory(cfg.model, cfg.train, shape, cfg.precision.compute)


def test_attention_memory_sp1_is_plain_attention():
    """sp=1: the full [b, h, s, s] scores of plain attention, kept and differentiated; the ratio is 1.
    tiny-llama at seq 4096 on dp=8: b = 1 row, 8 heads, 4 KV heads, head_dim 8."""
    th = attention_theory(1)
    b, S, H, KV, d = 1, 4096, 8, 4, 8
    assert (th["enabled"], th["sp"], th["strategy"], th["b"], th["heads"], th["kv_heads"], th["head_dim"]) == (
        False, 1, "plain", b, H, KV, d)
    assert th["sp1"]["terms"] == {"probabilities": b * H * S * S * 4, "score_gradients": 2 * b * H * S * S * 4,
                                  "qkv_out": b * S * (2 * H + 2 * KV) * d * 4}
    assert th["this"] == th["sp1"] and th["ratio"] == 1
    assert all(r["1"] == 1 for r in th["ratio_by_sp"].values())
    # in bf16 the probabilities also have their bf16 copy for the PV matmul
    bf16 = attention_theory(1, "ring", "precision.compute=bfloat16")["sp1"]["terms"]
    assert bf16["probabilities"] == b * H * S * S * (4 + 2) and bf16["qkv_out"] == b * S * 24 * d * 2


def test_attention_memory_blockwise_terms():
    """sp=8 at seq 4096 on dp=1 (b = 8 rows, t = 512 per rank): the blockwise kernel's per-step blocks."""
    b, S, H, KV, d, sp, t = 8, 4096, 8, 4, 8, 8, 512
    ring = attention_theory(sp, "ring")
    pair = b * H * (t // 2) * (t // 2)  # half-block query piece × half-block key piece
    assert ring["this"]["terms"] == {
        "block_scores": 4 * pair * (4 + 4 + 1),  # 2 × 2 pairs per step: scores, exp, mask
        "block_score_gradients": 3 * pair * 4,
        "running_state": sp * b * t * H * (d + 2) * 4,  # (out, max, sum) at each of the sp steps
        "kv_blocks": 2 * b * S * KV * d * 4 + 2 * b * S * 4,  # the whole K/V over the steps
        "qkv_out": b * t * (2 * H + 2 * KV) * d * 4}
    assert ring["strategies"]["allgather"]["terms"] == ring["this"]["terms"]  # the gathered K/V: same bytes
    assert ring["ratio"] == ring["strategies"]["ring"]["ratio"] == ring["ratio_by_sp"]["ring"]["8"]
    # ulysses: the whole sequence for h/sp = 1 head (KV heads repeated up to sp, one per rank),
    # queries in sp pieces of t against K/V blocks in 2 pieces
    u = attention_theory(sp, "ulysses")["this"]["terms"]
    upair = b * 1 * t * (t // 2)
    assert u == {"block_scores": sp * 2 * upair * 9, "block_score_gradients": 3 * upair * 4,
                 "running_state": sp * b * S * 1 * (d + 2) * 4, "kv_blocks": 2 * b * S * 1 * d * 4 + 2 * b * S * 4,
                 "qkv_out": b * t * (2 * H + 2 * KV) * d * 4 + b * S * (2 + 2) * d * 4}
    # the ring at sp=2 runs its scan for one trip, which XLA unrolls: two steps' blocks live at once
    two = attention_theory(2, "ring")
    assert two["this"]["terms"]["block_scores"] == 2 * 4 * two["b"] * H * (S // 4) ** 2 * 9
    # tp=2 × sp=4: 4 heads and 2 KV heads per tp rank; Ulysses cannot split 4 heads over sp=8
    tp = attention_theory(4, "ring", "mesh.tp=2")
    assert (tp["heads"], tp["kv_heads"]) == (4, 2)
    assert tp["ratio_by_sp"]["ulysses"]["8"] is None and tp["ratio_by_sp"]["ring"]["8"] is not None
    lines = "\n".join(_format_attention(ring))
    assert "attention memory per layer (sp=8, ring)" in lines and "sp=8 ring" in lines
    assert f"sp=8 {ring['ratio']:.4f}" in lines and "(1/sp: 1, 0.5, 0.25, 0.125)" in lines


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_attention_memory_falls_with_sp(strategy):
    """Per-device attention memory / plain attention at sp=1, seq 4096: falls monotonically with sp,
    at least as fast as 1/sp and, while the score blocks dominate, about as 1/sp² (each rank's
    blocks are (s/sp)² and the blockwise kernel keeps one K/V step's at a time, where plain
    attention keeps [s, s]). The compiled programs agree (see `attention_memory_theory`)."""
    ratios = {}
    for sp in (1, 2, 4, 8):
        th = attention_theory(sp, strategy)
        ratios[sp] = th["ratio"]
        assert th["ratio_by_sp"][strategy][str(sp)] == pytest.approx(th["ratio"])  # the trend line agrees
    assert ratios[1] == 1
    assert ratios[1] > ratios[2] > ratios[4] > ratios[8]
    for sp in (2, 4, 8):
        assert ratios[sp] * sp <= 1, (sp, ratios[sp])
        assert 0.5 <= ratios[sp] * sp * sp <= 2, (sp, ratios[sp])
    assert ratios[8] <= 1 / 4


# ---------------------------------------------------------------- pipeline parallelism

PP_CONFIG = ["model.preset=tiny-gpt2", "model.n_layers=4", "model.vocab_size=257", "mesh.pp=2", "mesh.dp=4",
             "train.microbatches=4", "train.global_batch=16", "precision.compute=float32"]


@pytest.fixture(scope="module")
def pipeline_plan():
    return plan(build_config(None, PP_CONFIG))


def test_pipeline_permutes_match_table(pipeline_plan):
    """The compiled step holds exactly the table's collective-permutes: 2 per tick (forward output
    down, input gradient up), one microbatch's per-device activations each.

    tiny-gpt2 on pp=2 × dp=4, 1F1B with 4 microbatches: 6 ticks; b = 16/4/4 = 1 row, s = 64, d = 64, fp32.
    Inspected on this JAX/XLA (CPU): 2 f32[1,64,64] permutes in the tick scan's body (6 trips); with
    precision.compute=bfloat16 the same 2 permutes are f32 too (bf16 converted to f32 around each),
    which the plan reports as the moved dtype."""
    p = pipeline_plan
    pl = p["pipeline"]
    assert (pl["enabled"], pl["schedule"], pl["p"], pl["v"], pl["m"], pl["ticks"]) == (True, "1f1b", 2, 1, 4, 6)
    assert (pl["b"], pl["s"], pl["d"], pl["dtype_bytes"]) == (1, 64, 64, 4)
    slot = 1 * 64 * 64 * 4
    cp = pl["collective_permute"]
    assert (cp["count"], cp["bytes_per_call"], cp["bytes"]) == (2 * 6, slot, 2 * 6 * slot)
    assert cp["moved_dtype"] == "float32" and cp["compiled_dtypes"] == ["float32"]
    assert p["unknown_trip_loops"] == 0
    assert p["collectives"]["collective-permute"] == cp["compiled"] == {"count": cp["count"], "bytes": cp["bytes"]}
    assert pl["buffer_bytes"] == (pl["act_depth"] + pl["grad_depth"]) * slot
    assert pl["bubble"]["formula"] == pytest.approx((2 - 1) / (4 + 2 - 1))
    assert pl["bubble"]["table"] == pytest.approx(pl["bubble"]["formula"])
    table = format_table(p)
    assert "pipeline (pp=2, 1f1b, v=1, m=4)" in table and "table: 2 × 6 ticks, float32" in table


def test_pipeline_zero_theory_per_stage(pipeline_plan):
    """A device holds one stage: Φ = layer stack / pp + embedding and final norm (replicated over pp),
    and the compiled arguments (ZeRO-0: 12 bytes per parameter) follow it within 10%."""
    p = pipeline_plan
    model = build_config(None, PP_CONFIG).model
    table = transformer.param_table(model)
    shared = sum(math.prod(leaf.shape) for name in ("embed", "final_norm")
                 for leaf in jax.tree.leaves(table[name], is_leaf=lambda x: isinstance(x, transformer.Leaf)))
    stack = transformer.count_params(model) - shared
    phi = stack // 2 + shared
    assert (p["pipeline"]["params"] == {"stack": stack, "experts": 0, "ep": 1, "shared": shared, "stage": phi}
            == stage_params(model, 2))
    assert p["params"] == stack + shared and p["theory"]["params"] == phi
    assert p["theory"]["fp32"]["argument_bytes"] == 12 * phi
    got = p["memory"]["argument_bytes"]
    assert abs(got - 12 * phi) <= 0.10 * 12 * phi, (got, 12 * phi)
    assert "theory Φ = stack / pp + embedding/head/final norm" in format_table(p)


def test_expert_parallel_theory_counts_a_share_of_the_experts():
    """tiny-moe on ep=4 × dp=2 (ZeRO-0): a device holds 1/4 of the experts and all else, and the compiled
    arguments follow 12 bytes per parameter of that within 10%."""
    cfg = build_config(None, ["model.preset=tiny-moe", "model.vocab_size=257", "model.seq_len=32", "mesh.ep=4",
                              "mesh.dp=2", "train.global_batch=16", "precision.compute=float32"])
    p = plan(cfg)
    table = transformer.param_table(cfg.model)
    experts = sum(math.prod(leaf.shape) for block in table["blocks"]
                  for leaf in jax.tree.leaves(block["moe"]["experts"], is_leaf=lambda x: isinstance(x, transformer.Leaf)))
    phi = p["params"] - experts + experts // 4
    assert p["theory"]["params"] == phi
    assert abs(p["memory"]["argument_bytes"] - 12 * phi) <= 0.10 * 12 * phi
    assert p["collectives"]["all-to-all"]["count"] > 0
    assert "1/4 of the experts" in format_table(p)


def test_pipeline_theory_arithmetic():
    """No compiling: interleaved v=2 under ZeRO-3 and Megatron sequence parallelism (the residual stream's
    sequence split over tp), bf16; and the element types read from compiled HLO text."""
    cfg = build_config(None, ["model.preset=tiny-llama", "model.n_layers=4", "model.vocab_size=257", "mesh.pp=2",
                              "mesh.fsdp=2", "mesh.tp=2", "mesh.dp=1", "train.zero_stage=3", "train.microbatches=4",
                              "train.global_batch=16", "train.pp_schedule=interleaved", "train.pp_virtual=2",
                              "train.sequence_parallel=true", "precision.compute=bfloat16"])
    shape, _ = validate(cfg, 8)
    pl = pipeline_theory(cfg.model, cfg.train, shape, cfg.precision.compute)
    b, s, d, E = 16 // 4 // 2, cfg.model.seq_len // 2, cfg.model.d_model, 2
    assert (pl["schedule"], pl["v"], pl["b"], pl["s"], pl["d"], pl["dtype_bytes"]) == ("interleaved", 2, b, s, d, E)
    assert pl["collective_permute"] == {"count": 2 * pl["ticks"], "bytes_per_call": b * s * d * E,
                                        "bytes": 2 * pl["ticks"] * b * s * d * E}
    assert pl["bubble"]["formula"] == pytest.approx(1 / (2 * 4 + 1))
    hlo = """HloModule m

ENTRY %main (a: bf16[1,64,64]) -> f32[1,64,64] {
  %a = bf16[1,64,64]{2,1,0} parameter(0)
  %c = f32[1,64,64]{2,1,0} convert(%a)
  %p = f32[1,64,64]{2,1,0} collective-permute(%c), channel_id=1, source_target_pairs={{0,1}}
  ROOT %q = bf16[8,4]{1,0} collective-permute(%a), channel_id=2, source_target_pairs={{1,0}}
}
"""
    assert permute_dtypes(hlo, 64 * 64) == ["float32"] and permute_dtypes(hlo, 32) == ["bfloat16"]
