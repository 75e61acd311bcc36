"""jaxllm plan: compiled memory follows the ZeRO theory, collectives are per step, the CLI contract,
the tensor-parallel and pipeline collective-permutes against compiled steps, the properties of
the attention-memory trend, and generation's cache lines for a model with linear (Gated DeltaNet)
layers. (The planner's per-layer tensor-parallel collectives and its attention memory are checked
against compiled programs in test_tensor_parallel.py and test_context_parallel.py; no test here
restates a formula of the planner.)

Runs on the 8 fake CPU devices of conftest.py. Each compile takes a few seconds, so the
in-process plans are cached per (stage, microbatches) for the module.
"""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from harness import subprocess_env
from jaxllm.config import build_config, validate
from jaxllm.errors import ConfigError
from jaxllm.models import transformer
from jaxllm.plan import format_table, plan
from jaxllm.plan.attention import attention_compiled, attention_memory_theory
from jaxllm.plan.hlo import KINDS, matmul_operands, permute_dtypes
from jaxllm.plan.report import _format_attention, _format_attention_compiled
from jaxllm.plan.tensor_parallel import tensor_parallel_theory

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
    return subprocess.run([sys.executable, "-m", "jaxllm", "plan", *args], cwd=ROOT, env=subprocess_env(8),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_argument_bytes_follow_zero_table(plans):
    """The compiled step's arguments per device are the planner's ZeRO theory (12Φ, 4Φ + 8Φ/N, 12Φ/N for
    fp32 parameters and Adam moments) within 10%, with Φ the model's parameter count; its temporaries the
    planner's estimate within 0.8-1.2 (ZeRO-3 at 0.68 of it when the update's new values were counted unsharded)."""
    p0, p1, p3 = plans(0), plans(1), plans(3)
    assert p0["params"] == transformer.count_params(build_config(None, SMALL + ["model.vocab_size=257"]).model)
    for stage, p in ((0, p0), (1, p1), (3, p3)):
        got, expected = p["memory"]["argument_bytes"], p["theory"]["fp32"]["argument_bytes"]
        assert abs(got - expected) <= 0.10 * expected, (stage, got, expected)
        assert p["config"]["zero_stage"] == stage and p["config"]["mesh"]["fsdp"] == N
        assert p["devices"] == 8
    ratio = p3["memory"]["argument_bytes"] / p0["memory"]["argument_bytes"]
    assert abs(ratio - 1 / N) <= 0.10 / N, ratio
    # Donation: the state's buffers are reused for the new state.
    for p in (p0, p1, p3):
        m = p["memory"]
        assert m["alias_bytes"] >= 0.95 * m["argument_bytes"]
        assert m["total_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
    # The temporaries follow the planner's estimate (plan/temporaries.py), printed beside them.
    for p in (p0, p1, p3):
        ratio = p["memory"]["temp_bytes"] / p["temporaries"]["total"]
        assert 0.8 <= ratio <= 1.2, (p["config"]["zero_stage"], p["memory"]["temp_bytes"], p["temporaries"])
    assert f"compiled / estimate = {ratio:.3f}" in format_table(p3)
    # Stage 0 gathers nothing; ZeRO-1 gathers the updated params; ZeRO-3 gathers weights at use.
    assert p0["collectives"]["all-gather"]["count"] == 0
    assert p1["collectives"]["all-gather"]["count"] > 0
    assert p3["collectives"]["all-gather"]["count"] > 0


@pytest.mark.slow
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


@pytest.mark.slow
def test_cli_json_contract(tmp_path):
    empty = tmp_path / "empty.toml"  # so the tiny-llama preset is not overridden by default.toml's model keys
    empty.write_text("")
    r = cli("--config", str(empty), "model.preset=tiny-llama", "mesh.fsdp=8", "mesh.dp=1",
            "train.zero_stage=3", "train.global_batch=8", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    assert out["devices"] == 8 and out["params"] > 0
    published = out["published_params"]  # the count without the vocabulary's padding rows (test_gpt_oss.py)
    model = build_config(str(empty), {"model.preset": "tiny-llama",
                                      "model.vocab_size": out["config"]["vocab_size"]}).model
    assert published == transformer.published_params(model) < out["params"]
    assert f"{published:,} without the vocabulary" in r.stderr
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
    theory_args = out["theory"]["fp32"]["argument_bytes"]
    assert abs(out["memory"]["argument_bytes"] - theory_args) <= 0.10 * theory_args
    assert set(out["theory"]["fp32"]["stages"]) == set(out["theory"]["bf16_seeds"]["stages"]) == set("0123")
    assert "memory per device" in r.stderr  # the human table goes to stderr with --json
    tp = out["tensor_parallel"]  # tp=1: the marker, no made-up collectives
    assert tp["enabled"] is False and tp["tp"] == 1
    assert all(c["forward"] == c["backward"] == [] for c in tp["collectives_per_layer"].values())
    at = out["attention"]  # sp=1: one device's attention (dense at tiny-llama's 64 tokens) against itself
    assert at["enabled"] is False and at["sp"] == 1 and at["strategy"] == "dense" and at["ratio"] == 1
    assert at["this"] == at["sp1"] and at["sp1"]["bytes_per_layer"] == sum(at["sp1"]["terms"].values())
    assert "attention memory per layer (sp=1, dense)" in r.stderr
    pl = out["pipeline"]  # pp=1: the marker; Φ is all parameters
    assert pl["enabled"] is False and pl["pp"] == 1 and pl["params"]["stage"] == out["params"]
    assert "pipeline (pp=" not in r.stderr


def test_cli_bad_config_exits_2(capsys):
    from jaxllm.cli.plan import main

    assert main(["mesh.tp=3"]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "mesh" in lines[0], err
    assert out == ""


def test_vocab_smaller_than_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError, match="model.vocab_size=256"):
        plan(build_config(None, SMALL + ["model.vocab_size=256"]))


@pytest.mark.slow
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


def test_tensor_parallel_theory_without_tp_is_a_marker():
    """tp = 1: no made-up collectives or activation savings. (The numbers for tp > 1 are checked against
    compiled programs: tests/test_tensor_parallel.py.)"""
    one = tp_theory("mesh.tp=1", "mesh.dp=8")
    assert one["enabled"] is False and one["tp"] == 1 and "no tensor parallelism" in one["note"]
    for setting in one["collectives_per_layer"].values():
        assert setting["forward"] == setting["backward"] == [] and setting["per_layer"] == setting["per_step"] == {}


@pytest.mark.slow
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


def test_attention_memory_table():
    """The plan's attention section names the strategy and lists the trend over sp. (The numbers are
    checked against compiled attention: tests/test_context_parallel.py.)"""
    ring = attention_theory(8, "ring")
    assert ring["enabled"] and 0 < ring["ratio"] < 1
    lines = "\n".join(_format_attention(ring))
    assert "attention memory per layer (sp=8, ring)" in lines and "sp=8 ring" in lines
    assert f"sp=8 {ring['ratio']:.4f}" in lines and "(1/sp: 1, 0.5, 0.25, 0.125)" in lines
    one = attention_theory(1)  # seq 4096: auto runs chunked, and the baseline is what runs
    assert (one["enabled"], one["strategy"], one["ratio"]) == (False, "chunked", 1)
    assert attention_theory(1, "ring", "model.attention_impl=dense")["strategy"] == "dense"


def ratios_by_sp(strategy: str, *extra: str) -> dict:
    return {sp: attention_theory(sp, strategy, *extra)["ratio"] for sp in (1, 2, 4, 8)}


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_attention_memory_falls_with_sp(strategy):
    """Per-device attention memory / one device's, by sp: against dense (auto's choice at seq 2048) it falls below
    1/sp at once and to under 1/16 at sp=8 (dense keeps [s, s] scores, every island runs the chunked kernel); against chunked
    at seq 2^18, where the rows and not the [512, 512] blocks dominate, it falls about as 1/sp (within 2/sp)
    for the ring and Ulysses, and more slowly for allgather, which holds the whole K/V. The compiled programs
    agree with these estimates (tests/test_context_parallel.py)."""
    dense = ratios_by_sp(strategy, "model.seq_len=2048")
    assert attention_theory(1, strategy, "model.seq_len=2048")["baseline"] == "dense"
    assert dense[1] == 1 and all(dense[sp] * sp <= 1 for sp in (2, 4, 8)) and dense[8] <= 1 / 16, dense
    long = ratios_by_sp(strategy, "model.seq_len=262144")
    assert long[1] == 1 and long[1] > long[2] > long[4] > long[8], long
    if strategy == "allgather":
        assert long[8] > ratios_by_sp("ring", "model.seq_len=262144")[8]
    else:
        assert all(long[sp] <= 2 / sp for sp in (2, 4, 8)), long


def compiled_attention(seq: int, *extra: str, devices: int = 1) -> dict:
    cfg = build_config(None, ["model.preset=tiny-llama", "model.vocab_size=257", f"model.seq_len={seq}",
                              "train.global_batch=1", "precision.compute=float32", *extra])
    shape, _ = validate(cfg, devices)
    return attention_compiled(cfg, shape)


def test_attention_compiled_per_implementation():
    """The planner's compiled attention temporaries (one layer's forward + backward, one device) per implementation:
    doubling seq from 1024 to 2048, dense's grow at least 3.5x (its [s, s] scores) and chunked's less than 2.5x
    (blocks of 512, O(s)); "chosen" follows model.attention_impl, and the table stars it (none under sp > 1)."""
    from jaxllm.ops.attention import IMPLEMENTATIONS

    short, long = compiled_attention(1024), compiled_attention(2048)
    assert set(IMPLEMENTATIONS) <= set(short)
    assert all(isinstance(short[k], int) and short[k] > 0 for k in ("dense", "chunked"))
    assert long["shape"] == {"b": 1, "seq_len": 2048, "heads": 8, "kv_heads": 4, "head_dim": 8, "dtype": "float32"}
    assert long["dense"] >= 3.5 * short["dense"], (short, long)
    assert long["chunked"] < 2.5 * short["chunked"], (short, long)
    assert long["chunked"] < long["dense"]
    assert short["chosen"] == "dense"  # auto below 4096 without a window
    for impl in ("dense", "chunked"):
        got = compiled_attention(1024, f"model.attention_impl={impl}")
        assert got["chosen"] == got["setting"] == impl and got[impl] == short[impl]
    windowed = compiled_attention(1024, "model.attention_impl=auto", "model.sliding_window=256")
    assert windowed["chosen"] == "chunked" and windowed["setting"] == "auto"
    line = "\n".join(_format_attention_compiled(windowed))
    assert "chunked* " in line and "dense* " not in line and "model.attention_impl=auto" in line
    cp = compiled_attention(1024, "mesh.sp=8", "mesh.dp=1", devices=8)  # islands: sp=1 shapes, nothing starred
    assert cp["shape"]["seq_len"] == 1024 and cp["dense"] == short["dense"] and cp["notes"]
    assert "*" not in "\n".join(_format_attention_compiled(cp)).split("\n")[0]


# ---------------------------------------------------------------- pipeline parallelism

PP_CONFIG = ["model.preset=tiny-gpt2", "model.n_layers=4", "model.vocab_size=257", "mesh.pp=2", "mesh.dp=4",
             "train.microbatches=4", "train.global_batch=16", "precision.compute=float32"]


@pytest.fixture(scope="module")
def pipeline_plan():
    return plan(build_config(None, PP_CONFIG))


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert p["pipeline"]["params"] == {"stack": stack, "experts": 0, "ep": 1, "shared": shared, "tp": 1, "tp_split": 0,
                                       "stage": phi, "stage_stack": stack // 2}
    assert p["params"] == stack + shared and p["theory"]["params"] == phi
    got = p["memory"]["argument_bytes"]
    assert abs(got - 12 * phi) <= 0.10 * 12 * phi, (got, 12 * phi)
    assert "theory Φ = stack / pp + embedding/head/final norm" in format_table(p)


def _llama_1b_flops(remat: str, loss_chunk: int = 0) -> tuple[dict, object]:
    """The FLOPs report of a 2-layer model of the LLaMA-1B preset's widths (vocabulary 128,256, seq 1,024, one row,
    dense attention), compiled on one device with `model.remat = remat` and `train.loss_chunk = loss_chunk`."""
    from harness import step_fns
    from jaxllm.plan.flops import flops_report

    cfg = build_config(None, {"model.preset": "llama-1b", "model.n_layers": 2, "model.seq_len": 1024,
                              "model.vocab_size": 128256, "model.attention_impl": "dense", "model.remat": remat,
                              "train.global_batch": 1, "train.loss_chunk": loss_chunk, "mesh.dp": 1})
    fns = step_fns(cfg, devices=1)
    compiled = fns.train_step.lower(fns.abstract_state, fns.abstract_batch(1, 1024)).compile()
    return flops_report(cfg, compiled.as_text(), 1, "h100"), cfg


@pytest.mark.slow
def test_compiled_flops_are_the_models_and_recomputation_adds_the_layers_forward_but_their_last_matmul():
    """The compiled step's matmul FLOPs (loops by their trip counts) against the model FLOPs counted with
    attention's full S×S, as dense attention computes it: 1 within 5% without recomputation; with full
    recomputation 1 + every layer's forward but its last matmul (the MLP's output projection, whose output the
    backward never reads) within 2%, so HFU shows above MFU; the default chunked loss 1 + the head's forward
    within 2% (its scan recomputes the logits in the backward)."""
    from jaxllm.plan.flops import recomputed_flops_per_token, recomputed_head_flops_per_token
    from jaxllm.trainer.step import loss_chunk

    plain, _ = _llama_1b_flops("none")
    assert plain["unknown_trip_loops"] == 0
    assert abs(plain["compiled"] / plain["model_full_attention"] - 1) <= 0.05
    full, cfg = _llama_1b_flops("full")
    expected = 1 + recomputed_flops_per_token(cfg) * cfg.model.seq_len / full["model_full_attention"]
    assert abs(full["compiled"] / full["model_full_attention"] / expected - 1) <= 0.02
    assert expected > 1.05 and full["hfu_over_mfu"] > plain["hfu_over_mfu"]
    chunked, cfg = _llama_1b_flops("none", -1)
    chunk = loss_chunk(cfg, {"sp": 1, "tp": 1})
    expected = 1 + recomputed_head_flops_per_token(cfg, chunk) * cfg.model.seq_len / chunked["model_full_attention"]
    assert chunk and abs(chunked["compiled"] / chunked["model_full_attention"] / expected - 1) <= 0.02
    roof = full["roofline"]
    assert roof["step_s"] == max(roof["compute_s"], roof["memory_s"]) and roof["bytes"] > 0



def test_the_h200_steps_flops_and_bytes_read_from_its_library_calls():
    """The LLaMA-1B step at seq 4,096 as XLA compiled it for a lent H200 (`tools.bench.profile_step`'s HLO;
    cuBLAS calls, cuDNN's causal fused attention, Triton GEMM fusions, the loss in 512-token chunks): its
    compiled FLOPs are the model's (attention's causal half) plus the loss's recomputed logits plus the fused
    backward's recomputed Q·Kᵀ over the causal half (L·S·width per token, a sixth of full attention's
    6·L·S·width) within 1%; its bytes at least its arguments read and its outputs written once, and not the
    stacked layers counted whole at every trip (that read 1.68 TB, 46× those)."""
    import gzip

    from jaxllm.plan.flops import flops_report, full_attention_flops_per_token, recomputed_head_flops_per_token
    from jaxllm.plan.hlo import _array_bytes, computations
    from jaxllm.trainer.step import loss_chunk

    path = os.path.join(ROOT, "tests", "fixtures", "hlo", "h200_llama1b_seq4096_train_step.hlo.txt.gz")
    with gzip.open(path, "rt") as f:
        text = f.read()
    cfg = build_config(None, {"model.preset": "llama-1b", "model.seq_len": 4096, "train.global_batch": 1,
                              "precision.compute": "bfloat16", "mesh.dp": 1})
    report = flops_report(cfg, text, 1, "h200")
    tokens = cfg.model.seq_len
    extra = recomputed_head_flops_per_token(cfg, loss_chunk(cfg, {"sp": 1, "tp": 1})) + \
        full_attention_flops_per_token(cfg) / 6
    assert report["unknown_trip_loops"] == 0 and report["uncounted_calls"] == 0
    assert abs(report["compiled"] / (report["model"] + extra * tokens) - 1) <= 0.01
    comps, entry = computations(text)
    arguments = sum(_array_bytes(i["type"]) for i in comps[entry] if i["opcode"] == "parameter")
    outputs = _array_bytes(comps[entry][-1]["type"])
    assert arguments + outputs <= report["roofline"]["bytes"] <= 10 * (arguments + outputs)



def test_a_pallas_kernels_call_is_counted_apart_from_the_matmul_flops():
    """A Triton (Pallas) call states no FLOPs: counted apart, so the report can say its figure is a lower bound; a
    library call that is no matmul (top-k) is neither; the dot beside them counts 2·m·n·k."""
    from jaxllm.plan.hlo import executed_matmul_flops

    hlo = """HloModule m

ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %t = f32[8,4]{1,0} custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"k"}
  %k = (f32[8,4]{1,0}, s32[]) custom-call(%a), custom_call_target="TopK"
  ROOT %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    assert executed_matmul_flops(hlo) == (2 * 8 * 4 * 16, 0, 1)

@pytest.mark.parametrize("layers", [4, 8])
def test_a_scan_over_stacked_weights_reads_each_layers_slice_once(layers):
    """A scan of L matmuls over weights stacked [L, n, n]: each trip's dynamic-slice reads one layer (XLA:CPU
    copies it out, and the dot reads the copy: three layers' bytes a trip), so the roofline's bytes are between 1
    and 3.5 times the stack's at L = 4 and at 8, not the stack counted whole at every trip (L + 2 times)."""
    from jaxllm.plan.hlo import executed_bytes

    n = 256
    stack = jax.ShapeDtypeStruct((layers, n, n), jnp.float32)
    x = jax.ShapeDtypeStruct((1, n), jnp.float32)
    step = lambda h, w: (jnp.tanh(h @ w), None)
    compiled = jax.jit(lambda x, ws: jax.lax.scan(step, x, ws)[0]).lower(x, stack).compile()
    moved = executed_bytes(compiled.as_text())
    assert 1.0 <= moved / (layers * n * n * 4) <= 3.5

# the products of the mesh's axes (issue 61): the theory's Φ per device takes a stage's share, 1/ep of the experts
# and 1/tp of what tensor parallelism splits
PRODUCT_PLANS = {
    "pp2_sp2_tp2_zero1": {"mesh.pp": 2, "mesh.sp": 2, "mesh.tp": 2, "train.sequence_parallel": True,
                          "train.microbatches": 2, "train.zero_stage": 1},
    "sp2_tp2_fsdp2_zero3_collective_matmul": {"mesh.sp": 2, "mesh.tp": 2, "mesh.fsdp": 2, "train.zero_stage": 3,
                                              "train.sequence_parallel": True, "model.collective_matmul": True},
    "deepseek_pp2_sp2_ep2_zero2_zb_v": {
        "model.preset": "tiny-moe", "model.attention": "mla", "model.mla.q_lora_rank": 16, "model.n_layers": 5,
        "model.segments": [{"layers": 1, "pattern": ["dense"]}, {"layers": 4, "pattern": ["moe"]}],
        "model.moe.n_shared_experts": 1, "model.moe.capacity_factor": 0.0, "model.mtp_depth": 1, "mesh.pp": 2,
        "mesh.sp": 2, "mesh.ep": 2, "train.zero_stage": 2, "train.microbatches": 4, "train.pp_schedule": "zb_v"},
    "pp2_dp4_zb_v": {"mesh.pp": 2, "mesh.dp": 4, "mesh.fsdp": 1, "train.microbatches": 4, "train.pp_schedule": "zb_v"},
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", PRODUCT_PLANS)
def test_the_argument_and_temporaries_estimates_hold_on_the_mesh_products(mesh):
    """The compiled step's arguments per device are the ZeRO theory's, and its temporaries the planner's estimate
    (`plan.temporaries`), within 0.8-1.2 on pp × sp × tp, sp × tp × fsdp with collective matmuls, a DeepSeek-shaped
    pp × sp × ep under ZB-V and a dense pp × dp under ZB-V (before tp and ep were counted in Φ, the first's arguments
    were 0.51 of the theory; without the V's moved weights the DeepSeek shape's temporaries are 1.27 of the estimate;
    with them summed to the schedule's parts rather than set against them, the dense ZB-V's are 0.78)."""
    from jaxllm.plan.compiled import compile_step, resolve
    from jaxllm.plan.hlo import memory_summary
    from jaxllm.plan.memory import theory
    from jaxllm.plan.pipeline import pipeline_theory
    from jaxllm.plan.temporaries import temporaries_theory

    base = {"model.preset": "tiny-llama", "model.vocab_size": 257, "model.seq_len": 32, "train.global_batch": 16,
            "precision.compute": "float32", "model.n_layers": 4}
    cfg, shape, _ = resolve(build_config(None, {**base, **PRODUCT_PLANS[mesh]}))
    got = memory_summary(compile_step(cfg, shape)[1])  # what `plan` reports, without the rest
    pipeline = pipeline_theory(cfg.model, cfg.train, shape, cfg.precision.compute)
    expected = theory(pipeline["params"]["stage"], shape["fsdp"], cfg.train.zero_stage)["fp32"]["argument_bytes"]
    assert 0.8 <= got["argument_bytes"] / expected <= 1.2, (got["argument_bytes"], expected)
    estimate = temporaries_theory(cfg, shape, pipeline)
    assert 0.8 <= got["temp_bytes"] / estimate["total"] <= 1.2, (got["temp_bytes"], estimate)


@pytest.mark.slow
def test_expert_parallel_theory_counts_a_share_of_the_experts():
    """tiny-moe on ep=4 × dp=2 (ZeRO-0): a device holds 1/4 of the experts and all else, and the compiled
    arguments follow 12 bytes per parameter of that within 10%."""
    cfg = build_config(None, ["model.preset=tiny-moe", "model.vocab_size=257", "model.seq_len=32", "mesh.ep=4",
                              "mesh.dp=2", "train.global_batch=16", "precision.compute=float32"])
    p = plan(cfg)
    table = transformer.param_table(cfg.model)
    experts = sum(math.prod(leaf.shape) for block in table["blocks"]
                  for leaf in jax.tree.leaves(block["moe"]["experts"], is_leaf=lambda x: isinstance(x, transformer.Leaf)))
    phi = p["params"] - experts + experts // 4  # counted from the parameter table
    assert abs(p["memory"]["argument_bytes"] - 12 * phi) <= 0.10 * 12 * phi
    assert p["collectives"]["all-to-all"]["count"] > 0
    assert "1/4 of the experts" in format_table(p)


def test_permute_dtypes_reads_the_moved_element_type():
    """The planner reports the element type a pipeline's collective-permutes move, read from HLO text."""
    hlo = """HloModule m

ENTRY %main (a: bf16[1,64,64]) -> f32[1,64,64] {
  %a = bf16[1,64,64]{2,1,0} parameter(0)
  %c = f32[1,64,64]{2,1,0} convert(%a)
  %p = f32[1,64,64]{2,1,0} collective-permute(%c), channel_id=1, source_target_pairs={{0,1}}
  ROOT %q = bf16[8,4]{1,0} collective-permute(%a), channel_id=2, source_target_pairs={{1,0}}
}
"""
    assert permute_dtypes(hlo, 64 * 64) == ["float32"] and permute_dtypes(hlo, 32) == ["bfloat16"]


def test_matmul_operands_reads_runners_and_operand_types():
    """The planner names what runs each matmul and its operands' types: a program compiled here (operands printed
    without types, looked up by name) and the form of an fp8 cuBLAS call on a GPU (BENCHMARKS.md, H200)."""
    f = jax.jit(lambda a, b, c: (a @ b, c.astype(jax.numpy.float32) @ b))
    x = jax.numpy.ones((8, 8), jax.numpy.float32)
    assert matmul_operands(f.lower(x, x, x.astype(jax.numpy.int8)).compile().as_text()) == {"dot f32×f32": 2}
    gpu = """HloModule m

ENTRY %main (a: f8e4m3fn[64,64], b: f8e5m2[64,64], s: f32[]) -> bf16[64,64] {
  %a = f8e4m3fn[64,64]{1,0} parameter(0)
  %b = f8e5m2[64,64]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %g = (bf16[64,64]{1,0}, s8[4194304]{0}) custom-call(%a, %b, %s, %s), custom_call_target="__cublas$lt$matmul$f8"
  %n = f32[64,64]{1,0} custom-call(%a), custom_call_target="SomethingElse"
  ROOT %r = bf16[64,64]{1,0} get-tuple-element(%g), index=0
}
"""
    assert matmul_operands(gpu) == {"__cublas$lt$matmul$f8 f8e4m3fn×f8e5m2": 1}


@pytest.mark.slow
@pytest.mark.parametrize("stage", (3, 0))
def test_generation_weights_copy_and_cache_are_in_the_compiled_program(plans, stage):
    """Under ZeRO-3 the generator's weights are a transient gathered copy: the whole model in the compute
    dtype on every device (not 1/fsdp of it), which with the KV cache the compiled generation program's
    temporaries hold; under ZeRO-0 in fp32 the stored parameters serve as they are (no copy)."""
    from jaxllm.generate import decode
    from jaxllm.mesh import make_mesh
    from jaxllm.trainer.step import make_step_fns

    p = plans(stage)
    g, n_params = p["generation"], p["params"]
    assert g["weights_copy_bytes"] == (pytest.approx(4 * n_params, rel=0.01) if stage == 3 else 0)  # fp32
    cfg = build_config(None, SMALL + [f"train.zero_stage={stage}", "model.vocab_size=257"])
    shape, _ = validate(cfg, N)
    fns = make_step_fns(cfg, make_mesh(shape, cfg))
    compiled = decode.lower(cfg, fns, fns.abstract_state.params, g["rows"], g["prompt"], g["new"]).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    stored = sum(math.prod(a.sharding.shard_shape(a.shape)) * 4 for a in jax.tree.leaves(fns.abstract_state.params))
    if stage == 3:  # about 1/N stored (biases without an embed dimension stay whole), N times that gathered
        assert N * stored < 1.1 * g["weights_copy_bytes"]
    assert temp >= g["weights_copy_bytes"] + g["cache_bytes"]


@pytest.mark.parametrize("fmt", ["default", "fp8", "fp8_block", "mxfp8"])
def test_what_a_matmul_keeps_for_its_backward_is_the_planners_per_element_bytes(fmt):
    """JAX's saved residuals of one covered bf16 matmul (x [2, 256, 256], w [256, 384]) against
    `matmul_formats.per_element`: within the few fp32 scalars and empty markers the formats add."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxllm.ops import fp8
    from jaxllm.plan.matmul_formats import per_element

    x, w = jnp.ones((2, 256, 256), jnp.bfloat16), jnp.ones((256, 384), jnp.bfloat16)
    coverage = fp8.Coverage() if fmt == "default" else fp8.Coverage({"mlp"}, fmt)

    def loss(a, b):
        with fp8.use(coverage):
            return fp8.einsum("mlp", "btk,kn->btn", a, b).astype(jnp.float32).sum()

    kept = sum(a.size * a.dtype.itemsize for a, _ in saved_residuals(loss, x, w))
    per_x, per_w = per_element(fmt, 2)
    assert abs(kept - (x.size * per_x + w.size * per_w)) <= 16, (kept, x.size * per_x + w.size * per_w)


# Three Gated DeltaNet layers and one attention layer (tiny-llama's widths; linear_attn's defaults: 2 key heads,
# 4 value heads, 32 dims each, conv kernel 4), the compute dtype bf16 so the state's two dtypes differ.
HYBRID = ["model.preset=tiny-llama", 'model.pattern=["linear","linear","linear","dense"]', "model.n_layers=4",
          "model.vocab_size=257", "train.global_batch=4", "precision.compute=bfloat16"]
LINEAR_LAYERS = 3


def generation_of(*extra: str, devices: int = 1) -> tuple[dict, dict[str, str], object]:
    """(the plan's generation theory, its printed lines by label, the config) for HYBRID + `extra` on the first
    `devices` devices: step functions built, nothing compiled."""
    from jaxllm.mesh import make_mesh
    from jaxllm.plan.generation import generation_theory
    from jaxllm.plan.report import _format_generation
    from jaxllm.trainer.step import make_step_fns

    cfg = build_config(None, [*HYBRID, *extra])
    shape, _ = validate(cfg, devices)
    g = generation_theory(cfg, make_step_fns(cfg, make_mesh(shape, cfg, devices=jax.devices()[:devices])))
    lines = _format_generation(g, cfg.precision.compute)
    labels = ("KV cache", "linear state", "cache, total", "rollout engine page pools")
    return g, {label: line for label in labels for line in lines if line.startswith(f"  {label} ")}, cfg


def test_the_rollout_engines_page_pools_are_planned_where_grpo_samples_on_it():
    """With rl.sampler = engine the plan prints the rollout engine's page pools on a device: `rl.engine_pages` a
    data-parallel shard, or what its slots' completions of up to seq_len tokens need at once (`engine.pool_pages`),
    in `cache.pool_bytes` (which tests/test_engine.py checks against the engine's own pools); on dp4 a device holds
    its shard's pages only. Nothing with the static sampler."""
    from jaxllm.generate import engine
    from jaxllm.plan.hlo import format_bytes

    dense = ('model.pattern=["dense"]', "model.n_layers=2", "model.seq_len=64", "train.global_batch=8")
    assert generation_of(*dense)[0]["engine_pool"] is None
    one, lines, _ = generation_of(*dense, "rl.sampler=engine")
    four, _, _ = generation_of(*dense, "rl.sampler=engine", "mesh.dp=4", devices=4)
    given, _, _ = generation_of(*dense, "rl.sampler=engine", "rl.engine_pages=9")
    row = 64 // engine.PAGE
    assert (one["engine_pool"]["pages"], four["engine_pool"]["pages"]) == (engine.pool_pages(8, row),
                                                                           engine.pool_pages(2, row))
    per_page = given["engine_pool"]["bytes"] // 9
    assert per_page > 0 and given["engine_pool"]["pages"] == 9
    assert [p["engine_pool"]["bytes"] for p in (one, four)] == [per_page * p["engine_pool"]["pages"] for p in (one, four)]
    assert printed_bytes(lines["rollout engine page pools"]) == format_bytes(one["engine_pool"]["bytes"])


def printed_bytes(line: str) -> str:
    """The size a cache line prints after its 28-character label."""
    return line[30:42].strip()


@pytest.mark.parametrize("mesh", [(), ("mesh.dp=2", "mesh.tp=2")])
def test_generation_prints_the_linear_layers_state_constant_in_the_length(mesh):
    """A hybrid model's plan prints the linear layers' state beside the KV cache: the state is
    `gated_deltanet.state_bytes` of a device's rows × the linear layers (the key-head groups split over tp),
    the same at seq_len 256 and 4096; the KV line is what the model's attention layer alone caches (an
    attention-only model of one layer), and it alone grows with the slots; the total is the two together."""
    from jaxllm.models import gated_deltanet
    from jaxllm.plan.hlo import format_bytes

    devices, dp, tp = (4, 2, 2) if mesh else (1, 1, 1)
    plans = {t: generation_of(f"model.seq_len={t}", *mesh, devices=devices) for t in (256, 4096)}
    m, dtype, rows = plans[256][2].model, plans[256][2].precision.compute, plans[256][2].train.global_batch
    sizes = gated_deltanet.sizes_of(m)
    state = LINEAR_LAYERS * gated_deltanet.state_bytes(sizes, rows // dp, dtype) // tp  # rows over dp, groups over tp
    for t, (g, lines, _) in plans.items():
        assert g["linear_state"]["bytes"] == state
        assert g["linear_state"]["per_row"]["bytes"] == gated_deltanet.state_bytes(sizes, 1, dtype)
        assert printed_bytes(lines["linear state"]) == format_bytes(state)
        assert lines["linear state"] == plans[256][1]["linear state"]  # formula and all: constant in t
        attention_only, _, _ = generation_of(f"model.seq_len={t}", *mesh, 'model.pattern=["dense"]', "model.n_layers=1",
                                             devices=devices)
        assert g["attention_layers"] == 1 and g["kv_cache_bytes"] == attention_only["cache_bytes"]
        assert printed_bytes(lines["KV cache"]) == format_bytes(attention_only["cache_bytes"])
        assert g["cache_bytes"] == g["kv_cache_bytes"] + state
        assert printed_bytes(lines["cache, total"]) == format_bytes(g["cache_bytes"])
    assert plans[4096][0]["kv_cache_bytes"] == 4096 // 256 * plans[256][0]["kv_cache_bytes"]
