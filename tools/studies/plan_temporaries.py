"""`python -m tools.studies.plan_temporaries [--only NAME]`: the compiled train step's temporaries per device beside
`jaxllm plan`'s estimate of them (`jaxllm/plan/temporaries.py`), on the mesh products and the common layouts.

Each case compiles the step (nothing runs) on fake CPU devices, 16 or 8 as it asks, one process per device count,
and prints compiled / estimate with the estimate's parts. Tiny models in fp32 (tiny-llama at seq 32, batch 16, the
test suite's GPT-2 for the fsdp rows), so weight-sized buffers weigh more than they would at scale. About 9 minutes on
2 CPU cores (27 layouts); BENCHMARKS.md "The planner's temporaries estimate" records the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TINY = {"model.preset": "tiny-llama", "model.vocab_size": 257, "model.seq_len": 32, "train.global_batch": 16,
        "precision.compute": "float32", "model.n_layers": 4}
SMALL_GPT2 = {"model.preset": "", "model.family": "gpt2", "model.n_layers": 4, "model.d_model": 256, "model.n_heads": 4, "model.d_ff": 1024,
              "model.seq_len": 32, "model.vocab_size": 0, "train.global_batch": 16, "precision.compute": "float32",
              "mesh.fsdp": 8, "mesh.dp": 1}
PP_SP_TP = {"mesh.pp": 2, "mesh.sp": 2, "mesh.tp": 2, "train.sequence_parallel": True, "train.microbatches": 2}
DEEPSEEK = {"model.preset": "tiny-moe", "model.attention": "mla", "model.mla.q_lora_rank": 16, "model.n_layers": 5,
            "model.segments": [{"layers": 1, "pattern": ["dense"]}, {"layers": 4, "pattern": ["moe"]}],
            "model.moe.n_shared_experts": 1, "model.moe.capacity_factor": 0.0, "model.mtp_depth": 1}
SMALL_MLA = {"model.mla.kv_lora_rank": 24, "model.mla.qk_nope_head_dim": 8, "model.mla.qk_rope_head_dim": 4,
             "model.mla.v_head_dim": 10}
MIXTRAL = {"model.preset": "tiny-moe", "mesh.sp": 2, "mesh.ep": 2, "mesh.dp": 4, "mesh.fsdp": 1}
CASES = {  # name -> (fake devices, overrides on TINY)
    "pp2×sp2×tp2 ZeRO-1 1F1B": (16, {**PP_SP_TP, "train.zero_stage": 1}),
    "pp2×sp2×tp2×fsdp2 ZeRO-3 1F1B ring": (16, {**PP_SP_TP, "mesh.fsdp": 2, "train.zero_stage": 3}),
    "pp2×sp2×tp2×fsdp2 ZeRO-3 interleaved Ulysses": (16, {**PP_SP_TP, "mesh.fsdp": 2, "train.zero_stage": 3,
                                                          "model.cp_strategy": "ulysses", "model.n_layers": 8,
                                                          "train.pp_schedule": "interleaved", "train.pp_virtual": 2}),
    "sp2×tp2×fsdp2 ZeRO-3 collective matmuls": (16, {"mesh.sp": 2, "mesh.tp": 2, "mesh.fsdp": 2, "train.zero_stage": 3,
                                                     "train.sequence_parallel": True, "model.collective_matmul": True}),
    "pp2×tp2×dp4 collective matmuls": (16, {"mesh.pp": 2, "mesh.tp": 2, "mesh.dp": 4, "mesh.fsdp": 1,
                                            "train.sequence_parallel": True, "model.collective_matmul": True,
                                            "train.microbatches": 2}),
    "DeepSeek pp2×sp2×ep2 ZeRO-2 ZB-V": (16, {**DEEPSEEK, "mesh.pp": 2, "mesh.sp": 2, "mesh.ep": 2, "train.zero_stage": 2,
                                              "train.microbatches": 4, "train.pp_schedule": "zb_v"}),
    "DeepSeek (small MLA) pp2×ep2×sp2×tp2 ZeRO-2 ZB-V": (16, {**DEEPSEEK, **SMALL_MLA, "mesh.pp": 2, "mesh.ep": 2,
                                                              "mesh.sp": 2, "mesh.tp": 2, "train.zero_stage": 2,
                                                              "train.sequence_parallel": True,
                                                              "train.microbatches": 4, "train.pp_schedule": "zb_v"}),
    "Mixtral sp2×ep2×dp4 capacity 1.25": (16, {**MIXTRAL, "model.moe.capacity_factor": 1.25}),
    "Mixtral sp2×ep2×dp4 dropless": (16, {**MIXTRAL, "model.moe.capacity_factor": 0.0}),
    **{f"GPT-2 fsdp8 ZeRO-{z}": (8, {**SMALL_GPT2, "train.zero_stage": z}) for z in range(4)},
    "dp8": (8, {"mesh.dp": 8, "mesh.fsdp": 1}),
    "dp8 full recomputation": (8, {"mesh.dp": 8, "mesh.fsdp": 1, "model.remat": "full"}),
    "tp2×fsdp4 ZeRO-3": (8, {"mesh.tp": 2, "mesh.fsdp": 4, "mesh.dp": 1, "train.zero_stage": 3}),
    "tp2×fsdp4 ZeRO-3 sequence parallel": (8, {"mesh.tp": 2, "mesh.fsdp": 4, "mesh.dp": 1, "train.zero_stage": 3,
                                               "train.sequence_parallel": True}),
    "pp2×dp4 GPipe": (8, {"mesh.pp": 2, "mesh.dp": 4, "mesh.fsdp": 1, "train.microbatches": 4,
                          "train.pp_schedule": "gpipe"}),
    "pp2×fsdp4 ZeRO-3 interleaved": (8, {"model.n_layers": 8, "mesh.pp": 2, "mesh.fsdp": 4, "mesh.dp": 1,
                                         "train.microbatches": 4, "train.zero_stage": 3,
                                         "train.pp_schedule": "interleaved", "train.pp_virtual": 2}),
    "MoE ep4×dp2 dropless": (8, {"model.preset": "tiny-moe", "mesh.ep": 4, "mesh.dp": 2, "mesh.fsdp": 1,
                                 "model.moe.capacity_factor": 0.0}),
    "pp2×dp4 ZB-V": (8, {"mesh.pp": 2, "mesh.dp": 4, "mesh.fsdp": 1, "train.microbatches": 4,
                         "train.pp_schedule": "zb_v"}),
    "pp2×dp4 ZB-H1": (8, {"mesh.pp": 2, "mesh.dp": 4, "mesh.fsdp": 1, "train.microbatches": 4,
                          "train.pp_schedule": "zb_h1"}),
    "pp2×dp4 ZB-V fp8 matmuls": (8, {"mesh.pp": 2, "mesh.dp": 4, "mesh.fsdp": 1, "train.microbatches": 4,
                                     "train.pp_schedule": "zb_v", "precision.matmul": "fp8"}),
    "LoRA on MLA fsdp2×tp2": (8, {"model.attention": "mla", "model.mla.q_lora_rank": 16, "model.lora.rank": 4,
                                  "model.lora.targets": ["q_a", "q_b", "kv_a", "kv_b", "o"], "mesh.fsdp": 2,
                                  "mesh.tp": 2, "mesh.dp": 2}),
    "LoRA ZB-H1 pp2×dp4": (8, {"model.lora.rank": 4, "mesh.pp": 2, "mesh.dp": 4, "mesh.fsdp": 1,
                               "train.microbatches": 4, "train.pp_schedule": "zb_h1"}),
    "LoRA sp2×tp2×fsdp2 ZeRO-3 collective matmuls": (16, {"model.lora.rank": 4, "mesh.sp": 2, "mesh.tp": 2,
                                                          "mesh.fsdp": 2, "train.zero_stage": 3,
                                                          "train.sequence_parallel": True,
                                                          "model.collective_matmul": True}),
    "LoRA dp2×fsdp4 ZeRO++ (hpZ, qwZ)": (8, {"model.lora.rank": 4, "mesh.dp": 2, "mesh.fsdp": 4, "train.zero_stage": 3,
                                             "train.zeropp.hpz": True, "train.zeropp.weights": True}),
    "LoRA fsdp8 ZeRO-3 host offload": (8, {"model.lora.rank": 4, "mesh.fsdp": 8, "mesh.dp": 1, "train.zero_stage": 3,
                                           "memory.offload_optimizer": True, "memory.offload_params": True}),
}
PARTS = ("weights", "weights_moved", "activations", "forward_slot", "logits", "pipeline")


def measure(name: str) -> dict:
    """Compile one case on this process's devices: {name, compiled, estimate, parts}."""
    from jaxllm.config import build_config
    from jaxllm.plan.compiled import compile_step, resolve
    from jaxllm.plan.hlo import memory_summary
    from jaxllm.plan.pipeline import pipeline_theory
    from jaxllm.plan.temporaries import temporaries_theory

    cfg, shape, _ = resolve(build_config(None, {**TINY, **CASES[name][1]}))
    compiled = memory_summary(compile_step(cfg, shape)[1])
    pipeline = pipeline_theory(cfg.model, cfg.train, shape, cfg.precision.compute)
    estimate = temporaries_theory(cfg, shape, pipeline)
    return {"name": name, "compiled": compiled["temp_bytes"], "estimate": estimate["total"], "note": estimate["note"],
            "parts": {k: estimate[k] for k in PARTS}, "arguments": compiled["argument_bytes"],
            "arguments_estimate": argument_estimate(cfg, shape, pipeline)}


def argument_estimate(cfg, shape: dict, pipeline: dict) -> int:
    """What `jaxllm plan` sets beside the compiled arguments: the ZeRO theory's, or fine-tuning's state under LoRA."""
    from jaxllm.plan.finetune import finetune_state
    from jaxllm.plan.memory import theory, zero_shards

    if cfg.model.lora.rank:
        return finetune_state(cfg, shape)["qlora_nf4" if cfg.model.lora.base_quant == "nf4" else "lora"]["argument_bytes"]
    stored = theory(pipeline["params"]["stage"], zero_shards(shape, cfg.train), cfg.train.zero_stage)
    return stored["fp32"]["argument_bytes"]


def run_group(devices: int, names: list[str]) -> list[dict]:
    """The cases of one device count, in a process of their own (the fake devices are set before JAX starts)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run([sys.executable, "-m", "tools.studies.plan_temporaries", "--worker", json.dumps(names)],
                          env=env, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        for name in json.loads(args.worker):
            print(json.dumps(measure(name)), flush=True)
        return
    names = [n for n in CASES if args.only in n]
    print("| layout (fp32, tiny) | arguments: compiled / estimate | temporaries: compiled | estimate | "
          "compiled / estimate | " + " | ".join(p.replace("_", " ") for p in PARTS) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(PARTS))
    for devices in sorted({CASES[n][0] for n in names}, reverse=True):
        for r in run_group(devices, [n for n in names if CASES[n][0] == devices]):
            print(_row(r, devices), flush=True)


def _row(r: dict, devices: int) -> str:
    """One case as a table row, in MiB."""
    mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    ratio = f"{r['compiled'] / r['estimate']:.2f}" if r["estimate"] else r["note"]
    estimate = mb(r["estimate"]) if r["estimate"] else ""
    return (f"| {r['name']} ({devices} devices) | {r['arguments'] / r['arguments_estimate']:.2f} | "
            f"{mb(r['compiled'])} | {estimate} | {ratio} | " + " | ".join(mb(r["parts"][p]) for p in PARTS) + " |")


if __name__ == "__main__":
    main()
