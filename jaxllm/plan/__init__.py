"""The planner: what one train step costs per device, from its compiled program and from theory.

`plan(cfg)` compiles the train step for a config on this machine's devices, without running it and
without loading any data, and reports per device (`format_table` writes it as the `jaxllm plan` table):

- memory of the compiled program (`memory_analysis()`: arguments, outputs, aliased (donated) bytes,
  temporaries, and total = arguments + outputs - aliased + temporaries), and beside the temporaries an
  estimate by part (`temporaries`: weight-sized buffers, activations, logits, pipeline buffers);
- collectives per step by kind, read from the optimized HLO, loops counted per trip;
- beside them, the ZeRO theory with Φ = parameter count and N = `fsdp` size, for this project's layout
  (fp32 params, grads and Adam moments) and for the seeds' bf16 layout;
- the tensor-parallel theory (no compiling): the activation collectives of one layer's forward and
  backward for TP alone, with sequence parallelism and with collective matmuls, and the activations
  autodiff saves per layer with and without sequence parallelism, beside the compiled temporaries;
- the attention memory per layer (no compiling): one device's attention at sp=1 against this config's
  context-parallel strategy (and the other two) at its sp, and beside it the compiled attention
  temporaries of one layer's forward + backward per implementation;
- generation (no compiling): the weights as the KV-cache generator reads them and its KV cache;
- with mesh.pp > 1, the pipeline, from the schedule's table: ticks, bubble, buffers, and the
  collective-permutes the table predicts beside the compiled ones;
- a hand-built all-reduce's and ZeRO++'s bytes beside their formulas, fine-tuning's train state (full,
  LoRA, QLoRA), and the compiled program's matmuls by operand types;
- FLOPs: the compiled step's matmuls (loops by their trip counts) beside the model FLOPs MFU counts, their
  ratio HFU / MFU, and with `chip` a roofline step time (`flops`).

The ZeRO theory's Φ is what one device holds: with pp > 1 the layer stack's parameters / pp plus the
embedding, head and final norm (replicated over pp); MoE experts count 1/ep of theirs, what tensor
parallelism splits 1/tp.

The modules, by topic: memory (the ZeRO theory and per-device sizes), temporaries, tensor_parallel, attention (and
context parallelism), pipeline, communication (all-reduce algorithms, ZeRO++), generation, finetune, flops;
compiled (compiling the step) and hlo (reading its program); report (the table's text).
"""

from __future__ import annotations

import logging
import math

import jax

from jaxllm.models import transformer
from jaxllm.plan.attention import attention_compiled, attention_memory_theory
from jaxllm.plan.communication import allreduce_report, zeropp_report
from jaxllm.plan.compiled import compile_step, host_state_bytes, remat_summary, resolve
from jaxllm.plan.finetune import finetune_state
from jaxllm.plan.flops import check_chip, flops_report
from jaxllm.plan.generation import generation_theory
from jaxllm.plan.matmul_formats import matmul_formats
from jaxllm.plan.hlo import collective_report, matmul_operands, memory_summary
from jaxllm.plan.memory import loss_theory, theory, zero_shards
from jaxllm.plan.pipeline import pipeline_compiled, pipeline_theory
from jaxllm.plan.report import format_table
from jaxllm.plan.temporaries import temporaries_theory
from jaxllm.plan.tensor_parallel import tensor_parallel_theory

__all__ = ["plan", "format_table"]


def plan(cfg, chip: str | None = None) -> dict:
    """Compile the train step for `cfg` (not run it) and report memory, collectives, FLOPs and theory per device;
    with `chip` (a `flops.CHIPS` key) a roofline step time on it.

    Raises UserError for a config that cannot run. Does not modify `cfg`.
    """
    log = logging.getLogger("jaxllm")
    check_chip(chip)
    cfg, shape, notes = resolve(cfg)
    for note in notes:
        log.info(note)
    m, t = cfg.model, cfg.train
    fns, compiled, seconds = compile_step(cfg, shape)
    memory = memory_summary(compiled)
    hlo = compiled.as_text()
    report = collective_report(hlo)
    n_params = transformer.count_params(m)
    pipeline = pipeline_theory(m, t, shape, cfg.precision.compute)
    pipeline = pipeline_compiled(pipeline, hlo, report["collectives"]["collective-permute"])
    return {
        "config": _config_summary(cfg, shape),
        "params": n_params,
        "published_params": transformer.published_params(m),
        "memory": {**{k: memory[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                              "total_bytes")},
                   "host_bytes": host_state_bytes(fns.abstract_state, compiled)},
        "temporaries": temporaries_theory(cfg, shape, pipeline),
        "remat": remat_summary(cfg, shape, memory["temp_bytes"]),
        "loss": loss_theory(cfg, shape),
        "matmul_formats": matmul_formats(cfg, shape),
        "collectives": report["collectives"],
        "unknown_trip_loops": report["unknown_trip_loops"],
        # a device holds one pipeline stage and its share of the experts: Φ = (stack − experts) / pp
        # + experts / (pp·ep) + embedding/head/final norm
        "theory": theory(pipeline["params"]["stage"], zero_shards(shape, t), t.zero_stage),
        "tensor_parallel": tensor_parallel_theory(m, t, shape, cfg.precision.compute),
        "attention": attention_memory_theory(m, t, shape, cfg.precision.compute),
        "attention_compiled": attention_compiled(cfg, shape),
        "pipeline": pipeline,
        "generation": generation_theory(cfg, fns, chip),
        "allreduce": allreduce_report(cfg, shape, hlo, n_params),
        "zeropp": zeropp_report(cfg, shape, hlo),
        "finetune": finetune_state(cfg, shape),
        "matmuls": matmul_operands(hlo),
        "flops": flops_report(cfg, hlo, math.prod(shape.values()), chip),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "compile_seconds": round(seconds, 3),
    }


def _config_summary(cfg, shape: dict) -> dict:
    """The resolved config's keys the plan reports: mesh, batch, model sizes, precision."""
    m, t = cfg.model, cfg.train
    return {
        "mesh": dict(shape),
        "zero_stage": t.zero_stage,
        "microbatches": t.microbatches,
        "global_batch": t.global_batch,
        "preset": m.preset,
        "family": m.family,
        "n_layers": m.n_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "n_kv_heads": m.n_kv_heads,
        "d_ff": m.d_ff,
        "vocab_size": m.vocab_size,
        "seq_len": m.seq_len,
        "remat": m.remat,
        "optimizer": t.optimizer,
        "compute": cfg.precision.compute,
        "sequence_parallel": t.sequence_parallel,
        "collective_matmul": m.collective_matmul,
    }
