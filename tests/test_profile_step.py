"""tools/bench/profile_step.py: the CPU step's profile adds up, and a GPU-shaped trace is read as a GPU trace.

The GPU trace here is written by hand in the layout jax's Perfetto export gives a CUDA device (a `/device:GPU:0`
process, one thread per stream, kernels named by their CUDA names with `hlo_op` and `hlo_module` in their args,
XProf's derived `XLA Ops` line beside them), with the compiled program's HLO text beside it; the real one is
read on the lent GPU (BENCHMARKS.md).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from harness import subprocess_env
from tools.bench import profile_step as ps

TINY = {"model.family": "llama", "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.d_ff": 128, "model.seq_len": 32, "model.vocab_size": 257, "train.global_batch": 4,
        "precision.compute": "float32"}


def test_cpu_profile_adds_up_and_finds_the_matmuls(tmp_path):
    """The command line on one CPU device: every op's time in one category and one part, the matmuls found."""
    cmd = [sys.executable, "-m", "tools.bench.profile_step", *(f"{k}={v}" for k, v in TINY.items()), "--steps", "2",
           "--warmup", "1", "--out", str(tmp_path), "--json"]
    done = subprocess.run(cmd, env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.splitlines()[-1])
    assert r["source"] == "host threads (thunks)" and r["events_per_step"] > 10
    cats = {c: v["ms"] for c, v in r["categories"].items()}
    assert set(cats) == set(ps.CATEGORIES)
    assert sum(cats.values()) == pytest.approx(r["device_ms"])
    assert sum(v["ms"] for v in r["parts"].values()) == pytest.approx(r["device_ms"])
    assert sum(o["ms"] for o in r["ops"]) == pytest.approx(r["device_ms"])
    matmuls = [o for o in r["ops"] if o["category"] == "matmul"]  # XLA:CPU: dots, and YNNPACK fusions around them
    assert cats["matmul"] > 0 and {o["opcode"] for o in matmuls} <= {"dot", "fusion"}
    assert {"mlp fwd", "mlp bwd", "head fwd", "head bwd"} <= {o["part"] for o in matmuls}
    assert {"attention fwd", "attention bwd", "mlp fwd", "mlp bwd", "optimizer"} <= set(r["parts"])
    assert not any(o["opcode"] in ps.CONTAINERS for o in r["ops"])  # a while loop holds its body's thunks
    assert 0 < r["busy_ms"] <= r["traced_step_ms"] and 0 <= r["idle_fraction"] < 1
    assert "% step" in done.stdout and (tmp_path / ps.HLO_FILE).exists()


@pytest.mark.slow
def test_the_decode_steps_profile_adds_up(tmp_path):
    """`tools.bench.engine_decode --profile` on one CPU device: a decode step's device time by category and by part
    (its attention, its MLP) adds up to the step's, read from the decode program's own trace and HLO."""
    model = ["model.preset=tiny-llama", "model.vocab_size=257", "precision.compute=float32"]
    cmd = [sys.executable, "-m", "tools.bench.engine_decode", "--rows", "4", "--prompt", "32", "--new", "8",
           "--chip", "h100", "--kernels", "xla", "--repeats", "1", "--profile", str(tmp_path), *model]
    done = subprocess.run(cmd, env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads((tmp_path / "xla_1" / "profile.json").read_text())
    assert r["events_per_step"] > 10 and {"attention", "mlp", "head"} <= set(r["parts"])
    assert sum(v["ms"] for v in r["categories"].values()) == pytest.approx(r["device_ms"])
    assert sum(v["ms"] for v in r["parts"].values()) == pytest.approx(r["device_ms"])
    assert r["categories"]["matmul"]["ms"] > 0 and "a decode step traced" in done.stdout


HLO = """HloModule jit_train_step, entry_computation_layout={(bf16[4,8]{1,0})->f32[4,8]{1,0}}

%fused_convert (param_0: bf16[4,8]) -> f32[4,8] {
  %param_0 = bf16[4,8]{1,0} parameter(0)
  ROOT %convert.1 = f32[4,8]{1,0} convert(%param_0), metadata={op_name="jit(train_step)/optimizer/convert_element_type"}
}

%fused_reduce (param_0.1: f32[4,8]) -> f32[4] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  %constant.2 = f32[] constant(0)
  ROOT %reduce.3 = f32[4]{0} reduce(%param_0.1, %constant.2), dimensions={1}, to_apply=%add, metadata={op_name="jit(train_step)/transpose(jvp(head))/reduce_sum"}
}

%gemm_dot (param_0.2: bf16[4,8], param_1.2: bf16[8,8]) -> bf16[4,8] {
  %param_0.2 = bf16[4,8]{1,0} parameter(0)
  %param_1.2 = bf16[8,8]{1,0} parameter(1)
  ROOT %dot.4 = bf16[4,8]{1,0} dot(%param_0.2, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp())/while/body/closed_call/mlp/dot_general"}
}

ENTRY %main.9 (Arg_0.1: bf16[4,8]) -> f32[4,8] {
  %Arg_0.1 = bf16[4,8]{1,0} parameter(0)
  %custom-call.3 = (bf16[4,8]{1,0}, s8[1024]{0}) custom-call(%Arg_0.1, %Arg_0.1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp()/while/body/closed_call/mlp/dot_general"}
  %custom-call.7 = (bf16[4,8]{1,0}, u8[0]{0}) custom-call(%Arg_0.1), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(train_step)/jvp()/while/body/closed_call/attention/dot_product_attention"}
  %gemm_fusion_dot.2 = bf16[4,8]{1,0} fusion(%Arg_0.1, %Arg_0.1), kind=kCustom, calls=%gemm_dot
  %loop_convert_fusion = f32[4,8]{1,0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_convert, metadata={op_name="jit(train_step)/jit(_where)/select_n"}
  %input_reduce_fusion = f32[4]{0} fusion(%loop_convert_fusion), kind=kInput, calls=%fused_reduce
  %all-reduce-start.1 = f32[4]{0} all-reduce-start(%input_reduce_fusion), replica_groups={}, to_apply=%add
  %while.2 = (s32[], f32[4,8]{1,0}) while(%tuple.1), condition=%cond, body=%body
  ROOT %copy.5 = f32[4,8]{1,0} copy(%loop_convert_fusion)
}
"""

# (line, kernel name, hlo_op, start µs, duration µs); two steps of 100 µs, the device idle 30 µs in each
KERNELS = [("stream", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "custom-call.3", 0, 20),
           ("stream", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", "custom-call.7", 20, 30),
           ("stream", "gemm_fusion_dot_2", "gemm_fusion_dot.2", 50, 5),
           ("stream", "loop_convert_fusion", "loop_convert_fusion", 55, 5),
           ("stream", "input_reduce_fusion", "input_reduce_fusion", 60, 4),
           ("stream", "MemcpyD2H", "while.2", 64, 1),
           ("stream", "copy_5", "copy.5", 65, 2),
           ("nccl", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "", 60, 3)]


def gpu_trace(path, kernels=KERNELS):
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14(Nccl)"}},
            {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    events = []
    for step in range(2):
        t0 = 1000 + 100 * step
        for line, kernel, op, ts, dur in kernels:
            args = {"hlo_module": "jit_train_step", "hlo_op": op} if op else {"correlation_id": 7}
            events.append({"ph": "X", "pid": 1, "tid": 13 if line == "stream" else 14, "ts": t0 + ts, "dur": dur,
                           "name": kernel, "args": args})
            if op:  # XProf's derived line repeats each op, and the host has its own events: neither counts
                events.append({"ph": "X", "pid": 1, "tid": 2, "ts": t0 + ts, "dur": dur, "name": op, "args": args})
                events.append({"ph": "X", "pid": 2, "tid": 5, "ts": t0 + ts - 5, "dur": 3, "name": op, "args": args})
        events.append({"ph": "X", "pid": 1, "tid": 13, "ts": t0 + 80, "dur": 10, "name": "other_program_kernel",
                       "args": {"hlo_module": "jit_other", "hlo_op": "fusion.1"}})
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": meta + events}, f)


def test_gpu_trace_by_category_part_and_idle_time(tmp_path):
    gpu_trace(tmp_path / "perfetto_trace.json.gz")
    events, source = ps.device_events(str(tmp_path / "perfetto_trace.json.gz"), "jit_train_step")
    assert source["from"] == "device streams" and len(events) == 2 * len(KERNELS)
    ops, computations = ps.parse_hlo(HLO)
    assert ops["custom-call.3"].target == "__cublas$lt$matmul" and ops["gemm_fusion_dot.2"].calls == ("gemm_dot",)
    r = ps.summarize(events, ops, computations, steps=2, traced_s=100e-6)
    ms = {c: round(v["ms"] * 1e3, 6) for c, v in r["categories"].items()}  # µs per step
    assert ms == {"matmul": 25, "attention": 30, "elementwise": 7, "reduction": 4, "collective": 3, "memcpy": 1,
                  "other": 0}
    assert r["device_ms"] * 1e3 == pytest.approx(70) and r["busy_ms"] * 1e3 == pytest.approx(67)
    assert r["idle_fraction"] == pytest.approx(0.33)
    parts = {p: round(v["ms"] * 1e3, 6) for p, v in r["parts"].items()}
    assert parts == {"attention fwd": 30, "mlp fwd": 20, "mlp bwd": 5, "optimizer": 5, "head bwd": 4,
                     "rest": 3, "unknown": 3}
    top = r["ops"][0]
    assert (top["op"], top["category"], top["count"], top["pct"]) == ("custom-call.7", "attention", 1, pytest.approx(30))


# The same step inside an XLA:GPU command buffer (a CUDA graph): every kernel names only the buffer as its op.
# XLA's kernels carry their fusion's name; cuBLAS's and cuDNN's (two kernels for one attention call) do not.
IN_GRAPH = [("stream", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "command_buffer_1", 0, 20),
            ("stream", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", "command_buffer_1", 20, 25),
            ("stream", "void cudnn::fusion::convert_dq_to_16bits<true>", "command_buffer_1", 45, 5),
            ("stream", "gemm_fusion_dot_2", "command_buffer_1", 50, 5),
            ("stream", "loop_convert_fusion", "command_buffer_1", 55, 5),
            ("stream", "input_reduce_fusion", "command_buffer_1", 60, 4),
            ("stream", "memcpy128", "command_buffer_1", 64, 1),
            ("stream", "copy_5", "command_buffer_1", 65, 2)]


def test_library_kernels_in_a_command_buffer_are_placed_by_the_schedule(tmp_path):
    gpu_trace(tmp_path / "perfetto_trace.json.gz", IN_GRAPH)
    events, _ = ps.device_events(str(tmp_path / "perfetto_trace.json.gz"), "jit_train_step")
    ops, computations = ps.parse_hlo(HLO)
    r = ps.summarize(events, ops, computations, steps=2, traced_s=100e-6)
    rows = {o["op"]: o for o in r["ops"]}
    assert (rows["custom-call.3"]["category"], rows["custom-call.3"]["part"], rows["custom-call.3"]["count"]) == (
        "matmul", "mlp fwd", 1)
    assert (rows["custom-call.7"]["category"], rows["custom-call.7"]["part"], rows["custom-call.7"]["kernels"]) == (
        "attention", "attention fwd", 2)
    assert rows["gemm_fusion_dot.2"]["part"] == "mlp bwd" and rows["copy.5"]["category"] == "elementwise"
    assert r["placed_ms"] * 1e3 == pytest.approx(50) and r["unnamed_ms"] * 1e3 == pytest.approx(1)  # the memcpy
