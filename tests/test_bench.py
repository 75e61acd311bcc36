"""tools/reference/plain_gpt.py computes what jaxllm computes (so the bench's baseline is honest),
tools.bench.train_step runs, and tools.bench.linear_attention runs and skips what does not fit."""

import functools
import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import step_fns, subprocess_env, train_step
from jaxllm.config import build_config, validate
from jaxllm.models import transformer
from jaxllm.trainer.state import TrainState
from tools.reference import plain_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Adam's first update is lr·g/(|g| + eps): with eps ≫ |g| it is ≈ lr·g (times 1/2 in warm-up), so comparing
# one step's weight changes compares the gradients themselves, not just their signs.
TINY = {"model.family": "gpt2", "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 0,
        "model.d_ff": 128, "model.seq_len": 16, "model.vocab_size": 257, "train.global_batch": 4,
        "precision.compute": "float32", "train.lr": 1.0, "train.eps": 1.0, "train.warmup_steps": 2,
        "train.steps": 10, "mesh.dp": 1}
FAMILIES = {"gpt2": {}, "llama": {"model.family": "llama", "model.n_kv_heads": 2}}


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_baseline_step_matches_jaxllm(family):
    """Same weights, same tokens: one train step of jaxllm and of the bench's plain baseline (model,
    clipping, AdamW with its decay mask and schedule) gives the same loss and the same weight changes."""
    cfg = build_config(None, {**TINY, **FAMILIES[family]})
    m, t = cfg.model, cfg.train
    fns = step_fns(cfg)
    module, c = plain_model(m)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, m.vocab_size, (t.global_batch, m.seq_len + 1), dtype=np.int32)
    # Random values in every leaf (biases and norms too), so the mapping of every leaf is exercised.
    # numpy, not jax.random: threefry for every leaf takes seconds to compile on CPU.
    old = jax.tree.map(lambda s: (0.05 * rng.standard_normal(s.shape)).astype(np.float32),
                       transformer.param_shapes(m))
    for norm in (old["final_norm"], old["blocks"][0]["ln1"], old["blocks"][0]["ln2"]):
        norm["scale"] += 1
    params = jax.device_put(old, fns.state_shardings.params)
    state = TrainState(step=jnp.int32(0), applied=jnp.int32(0), params=params, opt_state=jax.jit(fns.tx.init)(params),
                       guard=fns.fresh_guard())
    new_state, metrics = train_step(fns, state, tokens)

    plain_old = module.from_jaxllm(old)
    chex.assert_trees_all_equal_shapes(plain_old, jax.eval_shape(lambda k: module.init_params(c, k), jax.random.key(0)))
    tx = module.make_optimizer(lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps,
                               min_lr_ratio=t.min_lr_ratio, b1=t.beta1, b2=t.beta2, eps=t.eps,
                               weight_decay=t.weight_decay, grad_clip=t.grad_clip)
    plain_new, _, plain_loss = module.make_train_step(c, tx)(
        jax.tree.map(jnp.asarray, plain_old), jax.jit(tx.init)(plain_old), jnp.asarray(tokens))

    np.testing.assert_allclose(plain_loss, metrics["loss"], rtol=1e-5)
    assert float(metrics["grad_norm"]) > t.grad_clip  # clipping is part of what is compared
    ours_new = module.from_jaxllm(jax.device_get(new_state.params))
    for path, before in jax.tree_util.tree_leaves_with_path(plain_old):
        name = jax.tree_util.keystr(path)
        pick = lambda tree: functools.reduce(lambda x, k: x[k.key], path, tree)
        got, want = np.asarray(pick(ours_new)) - before, np.asarray(pick(plain_new)) - before
        assert np.abs(got - want).max() / (np.abs(want).max() + 1e-6) < 1e-4, name  # gpt2's bk: zero gradient


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bench_cli_runs_both(family):
    env = subprocess_env(1)  # one CPU device
    args = [f"model.family={family}", "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=0",
            "model.d_ff=64", "model.seq_len=16", "train.global_batch=2"]
    proc = subprocess.run([sys.executable, "-m", "tools.bench.train_step", *args, "--steps", "2", "--warmup", "1",
                           "--windows", "1", "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 1 and result["baseline"] == "ok" and result["config"]["family"] == family
    for name in ("jaxllm", "plain"):
        assert result[name]["tokens_per_s"] > 0 and 0 < result[name]["mfu"]
    assert result["overhead"] is not None
    assert "overhead:" in proc.stdout


def test_bench_config_error_exits_2(capsys):
    from tools.bench.train_step import main

    assert main(["model.d_model=64", "model.n_heads=3"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: model.d_model=64 is not divisible by model.n_heads=3")


def test_baseline_only_where_the_plain_model_applies():
    from tools.bench.train_step import baseline_unavailable

    def cfg(**over):
        return build_config(None, {**TINY, **over})

    assert baseline_unavailable(cfg(), 1) is None
    assert "devices" in baseline_unavailable(cfg(), 8)
    assert baseline_unavailable(cfg(**FAMILIES["llama"]), 1) is None
    assert "moe" in baseline_unavailable(cfg(**FAMILIES["llama"], **{"model.pattern": ["moe"]}), 1)
    assert "remat" in baseline_unavailable(cfg(**{"model.remat": "full"}), 1)
    assert "microbatches" in baseline_unavailable(cfg(**{"train.microbatches": 2}), 1)
    assert "adamw" in baseline_unavailable(cfg(**{"train.optimizer": "lion"}), 1)


@pytest.mark.slow
def test_bench_pipeline_reports_measured_and_table_bubble():
    """mesh.pp=2 on 2 fake CPU devices: the bench reports both bubbles (timings on CPU are not asserted)."""
    env = subprocess_env(2)
    p, mb = 2, 4
    args = ["model.preset=tiny-gpt2", "model.n_layers=4", f"mesh.pp={p}", "mesh.dp=1", f"train.microbatches={mb}",
            "train.global_batch=8", "model.seq_len=32", "model.vocab_size=257", "precision.compute=float32"]
    proc = subprocess.run([sys.executable, "-m", "tools.bench.train_step", *args, "--no-baseline", "--steps", "1",
                           "--warmup", "1", "--windows", "1", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mesh"] == {"pp": p}
    assert result["pipeline_bubble_table"] == pytest.approx((p - 1) / (mb + p - 1))
    assert isinstance(result["pipeline_bubble_measured"], float)
    stage = result["pipeline"]
    assert stage["stage_layers"] == 2 and stage["stage_rows"] == 2 and stage["stage_devices"] == 1
    assert stage["t_stage_microbatch_s"] > 0
    assert "from the table" in proc.stdout and "measured" in proc.stdout


def test_stage_config_is_one_stage_one_microbatch():
    from tools.bench.train_step import stage_config

    cfg = build_config(None, {**TINY, "model.n_layers": 8, "mesh.pp": 2, "mesh.dp": 2, "mesh.tp": 2,
                              "train.microbatches": 4, "train.global_batch": 16, "train.pp_schedule": "interleaved",
                              "train.pp_virtual": 2})
    shape, _ = validate(cfg, 8)
    s = stage_config(cfg, shape)
    assert (s.model.n_layers, s.train.global_batch, s.train.microbatches, s.train.pp_virtual) == (4, 2, 1, 1)
    assert validate(s, 2)[0] == {"pp": 1, "dp": 1, "fsdp": 1, "ep": 1, "sp": 1, "tp": 2}
    assert (cfg.model.n_layers, cfg.mesh.pp) == (8, 2)  # the original is left alone


# tools.bench.linear_attention at a few seconds' size: its three stacks as small as the layer allows.
LINEAR_TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
               "model.linear_attn.num_k_heads=2", "model.linear_attn.num_v_heads=2", "model.linear_attn.head_k_dim=16",
               "model.linear_attn.head_v_dim=16", "model.linear_attn.chunk=16"]


@pytest.mark.slow
def test_linear_attention_bench_runs_and_skips_what_does_not_fit():
    """Three stacks at t = 512 on one CPU device: each one's temporaries read and its call timed, or, above
    --max-temp-gib (here 15 MiB: between linear's and chunked's ~12 MiB and dense's ~19 MiB of [h, t, t] arrays),
    not run and said why; the table's ratios are against dense and chunked in the same run ("-" where the peer
    was not timed)."""
    proc = subprocess.run([sys.executable, "-m", "tools.bench.linear_attention", "--seq", "512", "--repeats", "1",
                           "--max-temp-gib", "0.015", "--json", *LINEAR_TINY], cwd=REPO, env=subprocess_env(1),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]["512"]
    assert set(row) == {"linear", "dense", "chunked"} and all(r["temp_bytes"] > 0 for r in row.values())
    assert row["linear"]["s"] > 0 and row["chunked"]["s"] > 0 and "s" not in row["dense"]
    assert row["dense"]["temp_bytes"] > 0.015 * 2**30 and row["dense"]["skipped"].endswith("MiB > --max-temp-gib 0.015")
    table = {line.split("|")[2].strip(): line.split("|")[3:-1] for line in proc.stdout.splitlines()
             if line.startswith("| 512 |")}
    # columns: temporaries, s/call, temps / dense, temps / chunked, time / dense, time / chunked
    assert table["dense"][1].strip().startswith("not run: temporaries")
    assert [c.strip() for c in table["chunked"][3:]] == ["1.000", "-", "1.000"]
    assert [c.strip() for c in table["linear"][4:]] == ["-", f"{row['linear']['s'] / row['chunked']['s']:.3f}"]
