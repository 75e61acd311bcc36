"""tools.plan: compiled memory follows the ZeRO table, collectives are per step, the CLI contract.

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

from jaxllm.config import build_config
from jaxllm.errors import ConfigError
from jaxllm.models import transformer
from tools.collectives import KINDS
from tools.plan import plan, theory

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
