"""The training loop: set up, train with logging/eval/checkpoints, then plot and sample.

Everything that can fail because of the user's input (config, data, an existing run
directory, a checkpoint that does not fit) is checked before the run directory is
written to. Host syncs happen only at log, eval and checkpoint steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import batch as batch_lib
from jaxllm import data as data_lib
from jaxllm import stack as stack_lib
from jaxllm.config import build_config, flatten, split_run_source, to_dict, to_toml, validate
from jaxllm.data import dataset, prefetch
from jaxllm.errors import CheckpointError, ConfigError, Stopped, TrainingDiverged, UserError
from jaxllm.eval import run as eval_run, tasks as eval_tasks
from jaxllm.generate import generate
from jaxllm.interop import gguf_io, hf, peft
from jaxllm.mesh import barrier, initialize_distributed, make_mesh
from jaxllm.models import attention, gated_deltanet, lora, transformer
from jaxllm.parallel.pipeline_schedules import bubble_formula, bubble_fraction
from jaxllm.rl import prompts
from jaxllm.rl.rollout_batches import RolloutBatches
from jaxllm.schema import Config
from jaxllm.trainer import checkpoint as ckpt
from jaxllm.trainer import faults, goodput, preemption, preference, profiling, wandb_log
from jaxllm.trainer import metrics as metrics_lib
from jaxllm.trainer import state as state_lib
from jaxllm.trainer.step import make_step_fns, trained

log = logging.getLogger("jaxllm")


def resolve(cfg: Config, *, data: bool = True):
    """Fill `model.vocab_size` from the tokenizer and validate against the devices (`data`: `validate`'s).

    Returns (tokenizer, mesh shape, notes to log); raises UserError on any problem.
    """
    tokenizer = data_lib.get_tokenizer(cfg.data.tokenizer)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.vocab_size
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the {tokenizer.name} tokenizer's "
                          f"{tokenizer.vocab_size}; raise it or set 0")
    shape, notes = validate(cfg, jax.device_count(), data=data)
    return tokenizer, shape, notes


def prepare(cfg: Config):
    """`resolve`, then load the data (`data/dataset.py`; a GRPO run's prompts, `rl/prompts.py`) and fix the
    steps it decides (train.epochs, train.warmup_ratio): (tokenizer, mesh shape, notes, data)."""
    tokenizer, shape, notes = resolve(cfg)
    data = prompts.load(cfg, tokenizer) if cfg.train.objective == "grpo" else dataset.load(cfg, tokenizer)
    notes = notes + dataset.resolve_schedule(cfg, data)
    validate(cfg, jax.device_count())  # the steps may have changed
    return tokenizer, shape, notes, data


def _check_run_dir(cfg: Config) -> bool:
    """Whether to resume from a checkpoint; refuse to overwrite another run."""
    if cfg.train.resume:
        if ckpt.has_checkpoints(cfg.run.dir):
            return True
        log.info("train.resume=true: no checkpoint in %s yet, so training starts at step 0", cfg.run.dir)
        return False
    used = [n for n in ("metrics.jsonl", "checkpoints") if os.path.exists(os.path.join(cfg.run.dir, n))]
    if used:
        raise ConfigError(f"run.dir '{cfg.run.dir}' already holds a run; set train.resume=true to continue it "
                          "or choose another run.dir")
    return False


def _check_resumable(cfg: Config, meta: dict) -> None:
    saved = meta.get("config", {})
    params_only = state_lib.saved_fields(meta) == state_lib.PARAMS_ONLY  # its optimizer starts fresh
    for section in ("model",) if params_only else ("model", "train.optimizer"):
        part, _, key = section.partition(".")
        a, b = saved.get(part, {}), to_dict(cfg)[part]
        if part == "model":  # read as this version reads it: keys added since (features) from its family
            a = to_dict(build_config(None, {f"model.{k}": v for k, v in flatten(a).items()}))["model"]
        if key:
            a, b = a.get(key), b.get(key)
        if a != b:
            raise ConfigError(f"run.dir '{cfg.run.dir}' was trained with different {section} settings; "
                              "resume with the same ones or choose another run.dir")
    window = saved.get("train", {}).get("spike_window")  # the guard's loss history has its length
    if window is not None and not params_only and window != cfg.train.spike_window:
        raise ConfigError(f"run.dir '{cfg.run.dir}' was trained with train.spike_window={window}; resume with the "
                          "same window or choose another run.dir")


def _restore(cfg: Config, fns):
    """(state, step, metadata) of the newest checkpoint that restores onto this run's mesh; one saved before a
    state field existed gets that field's default."""
    def check(meta):
        _check_resumable(cfg, meta)
        state_lib.check_fields(meta, f"run.dir '{cfg.run.dir}'")

    target = lambda meta: state_lib.as_saved(_stored(cfg, fns.abstract_state), state_lib.saved_fields(meta))
    saved, meta = ckpt.restore_newest(cfg.run.dir, target, check, verify=cfg.train.checkpoint_checksums)
    if state_lib.saved_fields(meta) == state_lib.PARAMS_ONLY:
        log.info("the checkpoint holds parameters only (an imported model): the optimizer starts fresh")
        state = fns.start(saved["params"])
    else:
        state = state_lib.complete(saved, {"guard": fns.fresh_guard()})
    if cfg.model.lora.rank:  # the checkpoint holds the adapters; the frozen base is read again from its source
        state = state.replace(params=lora.combine(state.params, _frozen_base(cfg, fns)))
    start = int(state.step)
    if start >= cfg.train.steps:
        raise ConfigError(f"run.dir '{cfg.run.dir}' is already at step {start} >= train.steps={cfg.train.steps}; "
                          "raise train.steps to train further")
    return state, start, meta


def _stored(cfg: Config, state):
    """What a checkpoint holds of a state: under LoRA its trainable part (the adapters; the base is `init.from`'s,
    or the seed's), else all of it."""
    if not cfg.model.lora.rank:
        return state
    return state.replace(params=lora.split(state.params, trained(cfg.model)[1])[0])


def checkpoint_params(cfg: Config, fns, run_dir: str, step: int | None):
    """The parameters of `run_dir`'s checkpoint `step` (None: the newest): under LoRA its adapters on the base
    read again from where the run's base came from."""
    if not cfg.model.lora.rank:
        return ckpt.read_params(run_dir, step, fns.abstract_state.params, cfg.train.checkpoint_checksums)
    adapters = ckpt.read_params(run_dir, step, _stored(cfg, fns.abstract_state).params, cfg.train.checkpoint_checksums)
    return lora.combine(adapters, _frozen_base(cfg, fns))


def with_stored_base(cfg: Config, fns, params):
    """A LoRA model's adapters on its base as the source stores it (fp32; quantized under QLoRA), read again: a loaded
    or training model holds its frozen base in the compute dtype, which a merged export must not round to."""
    if not cfg.model.lora.rank:
        return params
    if cfg.init.from_:
        start = _source_params(cfg, fns)
    else:
        start = jax.jit(lambda: transformer.init_params(cfg.model, jax.random.key(cfg.train.seed)),
                        out_shardings=fns.state_shardings.params)()
    mask = trained(cfg.model)[1]
    return lora.combine(lora.split(params, mask)[0], lora.split(start, mask)[1])


def _frozen_base(cfg: Config, fns):
    """A LoRA run's frozen part of the parameters, read again from where its base came from (as at step 0)."""
    return lora.split(initial_state(cfg, fns).params, trained(cfg.model)[1])[1]


def initial_state(cfg: Config, fns):
    """The state at step 0: random parameters, or those `init.from` names, with a fresh optimizer."""
    if not cfg.init.from_:
        return fns.init(cfg.train.seed)
    log.info("parameters from %s; the optimizer starts fresh", cfg.init.from_)
    return fns.start(_source_params(cfg, fns))


def _source_params(cfg: Config, fns):
    """`init.from`'s parameters; under LoRA, its weights as the frozen base with fresh adapters."""
    source, m = cfg.init.from_, cfg.model
    if source.startswith("hf:"):
        base = hf.load_params(source[3:], lora.base_model(m), fns.base_shardings)
    elif source.startswith("gguf:"):
        base = hf.load_from(gguf_io.GgufFiles(source[5:]), lora.base_model(m), fns.base_shardings)
    else:
        run_dir, step = split_run_source(source)
        target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=sh),
                              transformer.param_shapes(lora.base_model(m)), fns.base_shardings)  # as saved: fp32
        try:
            base = ckpt.read_params(run_dir, step, target, cfg.train.checkpoint_checksums)
        except CheckpointError as e:
            raise CheckpointError(f"init.from: {e}") from None
    params = fns.with_adapters(base)
    return peft.load_adapter(cfg.init.adapter, params, m) if cfg.init.adapter else params


def reference_params(cfg: Config, fns):
    """GRPO's and DPO's frozen reference, a function of the policy's parameters: under LoRA the policy with its
    adapters off (the same base arrays); else the starting parameters (`init.from`, else the seed's random ones),
    read again whether or not the run resumes, in the compute dtype and laid out like the policy's."""
    shardings = fns.state_shardings.params
    if cfg.model.lora.rank:  # laid out as the policy (its zero Bs would otherwise come out replicated)
        return jax.jit(lora.adapters_off, in_shardings=(shardings,), out_shardings=shardings)
    params = _source_params(cfg, fns) if cfg.init.from_ else fns.init(cfg.train.seed).params
    cast = jax.jit(lambda p: transformer.compute_weights(p, jnp.dtype(cfg.precision.compute)),
                   in_shardings=(shardings,), out_shardings=shardings)
    fixed = cast(params)
    return lambda _: fixed


def flops_per_token(cfg: Config) -> float:
    """The model's training FLOPs per token (`metrics.model_flops_per_token`, its attention term over the attention
    layers; linear layers count their recurrence, `gated_deltanet.recurrence_flops_per_token`). Under LoRA the
    base model's, 6N as for full fine-tuning: the same model on the same tokens, though the step skips the frozen
    weights' gradients."""
    m = lora.base_model(cfg.model)
    n = transformer.count_params(m, embeddings=False, active=True) + m.d_model * m.vocab_size  # + LM head matmul
    linear = m.n_layers - stack_lib.attention_layers(m)  # Gated DeltaNet's chunked recurrence in place of attention
    recurrence = gated_deltanet.recurrence_flops_per_token(gated_deltanet.sizes_of(m), m.linear_attn.chunk)
    return (metrics_lib.model_flops_per_token(n, stack_lib.attention_layers(m), m.seq_len, attention.score_width(m))
            + linear * recurrence)


def peak_flops(cfg: Config) -> float:
    """Peak FLOP/s of all devices together; on CPU a matmul in the compute dtype measured now
    (fake devices share the same cores, so it is not multiplied by their count)."""
    dev = jax.devices()[0]
    peak = metrics_lib.peak_flops_per_device(dev, "bfloat16")  # MFU's convention: the chip's bf16 peak
    if peak is None:
        return metrics_lib.measure_matmul_peak(jnp.dtype(cfg.precision.compute))
    return peak * jax.device_count()


def sample(params, cfg: Config, tokenizer, prompt: str, n_tokens: int, seed: int = 0, on=None,
           temperature: float = 0.8) -> str:
    """The prompt and up to `n_tokens` sampled after it (`jaxllm.generate`, with the KV cache, on the mesh of
    `on`: a StepFns, Layout or Mesh where the parameters live), ending early at a stop id (the end-of-text
    id, and an `hf:DIR` tokenizer's generation_config.json eos ids) or at a token the tokenizer cannot
    decode. A request past the model's positions is shortened to fit, with a log line."""
    ids = list(tokenizer.encode(prompt)) or [tokenizer.eot]
    room = transformer.max_positions(cfg.model) - len(ids)
    if n_tokens > room:
        log.info("sample: %d new tokens after a %d-token prompt would pass model.max_positions=%d; generating %d",
                 n_tokens, len(ids), transformer.max_positions(cfg.model), max(room, 0))
        n_tokens = room
    if n_tokens < 1:
        return tokenizer.decode(np.asarray(ids, np.uint32))
    (done,) = generate(params, cfg, [ids], n_tokens, on=on, temperature=temperature, stop_ids=tokenizer.stop_ids,
                       seed=seed)
    return completion_text(tokenizer, ids, done.tokens)


def completion_text(tokenizer, prompt_ids: list[int], tokens) -> str:
    """The prompt and its new tokens as text, up to the first stop id or token the tokenizer cannot decode."""
    ids = list(prompt_ids)
    for t in np.asarray(tokens).tolist():
        if t in tokenizer.stop_ids or t >= tokenizer.vocab_size:
            break
        ids.append(t)
    return tokenizer.decode(np.asarray(ids, np.uint32))


def _log_setup(cfg: Config, shape: dict, notes: list[str], data, fns) -> None:
    t = cfg.train
    mesh_desc = " ".join(f"{a}={n}" for a, n in shape.items() if n > 1) or "1 device"
    log.info("mesh: %s over %d %s device(s); %s", mesh_desc, jax.device_count(), jax.devices()[0].platform,
             data.description)
    for note in notes:
        log.info(note)
    log.info("model: %s, %.2fM parameters; zero_stage=%d, microbatches=%d, compute %s", cfg.model.family,
             transformer.count_params(cfg.model) / 1e6, t.zero_stage, t.microbatches, cfg.precision.compute)
    if fns.schedule is not None:
        s = fns.schedule
        log.info("pipeline: %s over %d stages × %d chunk(s), %d microbatches, %d ticks; bubble %.1f%% of the "
                 "table (formula %.1f%%); %d stage input(s) buffered", s.name, s.stages, s.chunks, s.microbatches,
                 s.ticks, 100 * bubble_fraction(s), 100 * bubble_formula(s), s.act_depth)


@dataclass
class _Run:
    """What the step loop shares: the config, the compiled programs, where output goes, and the
    newest checkpoint whose loss and gradient norm were finite."""
    cfg: Config
    fns: object
    data: object
    step_fn: object
    eval_fn: object
    mngr: object = None
    writer: object = None
    bar: object = None
    flops_per_token: float = 0.0
    peak: float = 0.0
    good_checkpoint: int | None = None
    pending: list = field(default_factory=list)  # (step, its consecutive-skip count) not yet read
    tasks: list = field(default_factory=list)  # benchmark tasks scored at each validation (train.eval_tasks)
    tokenizer: object = None
    last: dict = field(default_factory=lambda: {"loss": math.nan, "val_loss": math.nan})
    clock: goodput.Clock = field(default_factory=goodput.Clock)  # where the wall time goes (trainer/goodput.py)
    profiler: object = None
    wandb: object = None  # a wandb_log.Mirror, which the writer sends its rows to once it exists
    since: tuple = (0.0, 0)  # (time.time(), step) of the last training row: step_time_s is over the steps since


def _show(run: _Run, msg: str) -> None:
    run.bar.write(msg) if run.bar else log.info(msg)


def _metrics_row(run: _Run, step: int, metrics, dt: float, since: int) -> dict:
    """The logged row of one step, from its metrics on the host (padding_frac: over the steps after `since`;
    dt: seconds per step over those steps)."""
    cfg = run.cfg
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    row = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
           "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
           "mfu": metrics_lib.mfu(tokens_per_step / dt, run.flops_per_token, run.peak),
           "padding_frac": run.data.padding_frac(range(since, step))}
    # the objective's own metrics (GRPO: clip_frac, kl) and MoE's router statistics
    row.update({k: float(v) for k, v in metrics.items() if k not in row and k != "moe_load"})
    if cfg.train.objective == "grpo":  # those of the rollouts this step trained on
        row.update(run.data.metrics(step - 1))
    if hasattr(run.data, "source_metrics"):  # a mixture's tokens and epochs per source
        row.update(run.data.source_metrics(step))
    # each expert's share of the routed pairs, one column per expert
    row.update({f"moe_load_{e}": float(v) for e, v in enumerate(metrics.get("moe_load", []))})
    return row


def _write_row(run: _Run, row: dict) -> None:
    run.last["loss"] = row["loss"]
    if not run.writer:
        return
    run.writer.write(row)
    msg = (f"step {row['step']:>6} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad_norm {row['grad_norm']:.3f} | "
           f"{row['tokens_per_s']:,.0f} tok/s | {row['step_time_s'] * 1e3:.0f} ms | mfu {row['mfu'] * 100:.1f}%")
    if row["padding_frac"]:
        msg += f" | padding {row['padding_frac'] * 100:.0f}%"
    if row.get("skipped_total"):
        msg += f" | skipped {row['skipped_total']:.0f}" + (" (this step)" if row["skipped"] else "")
    if row.get("loss_scale", 1) != 1:
        msg += f" | loss scale 2^{math.log2(row['loss_scale']):.0f}"
    if "reward_mean" in row:
        msg += (f" | reward {row['reward_mean']:.3f} ± {row['reward_std']:.3f} | clip {row['clip_frac'] * 100:.1f}%"
                + (f" | kl {row['kl']:.4f}" if "kl" in row else "") + f" | len {row['completion_len']:.1f}")
    msg += _preference_text(row)
    if "moe_balance" in row:
        msg += (f" | moe balance {row['moe_balance']:.3f} z {row['moe_z']:.2f} load max/mean "
                f"{row['moe_load_max_over_mean']:.2f} dropped {row['moe_dropped'] * 100:.1f}%")
    _show(run, msg)


def _preference_text(row: dict, prefix: str = "") -> str:
    """DPO's reward accuracy and margin for the console (every metric is in metrics.jsonl)."""
    if f"{prefix}rewards/accuracies" not in row:
        return ""
    return (f" | {prefix}accuracy {row[f'{prefix}rewards/accuracies']:.3f} | {prefix}margin "
            f"{row[f'{prefix}rewards/margins']:.3f}")


def _resume_point(run: _Run) -> str:
    return (f"the newest checkpoint with a finite loss is step {run.good_checkpoint} in "
            f"{ckpt.checkpoint_dir(run.cfg.run.dir)}; resume from it with train.resume=true"
            if run.good_checkpoint is not None else "no checkpoint was saved before it")


def _check_finite(run: _Run, row: dict) -> None:
    """A non-finite loss or gradient norm the guard did not skip (train.skip_nonfinite=false) ends the run,
    pointing at the newest good checkpoint."""
    if row.get("skipped") or (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
        return
    raise TrainingDiverged(f"loss {row['loss']}, gradient norm {row['grad_norm']} at step {row['step']}: "
                           f"lower train.lr, raise train.warmup_steps or train.grad_clip, or check the data; "
                           f"{_resume_point(run)}")


def _watch_skips(run: _Run, step: int, metrics, wait: bool) -> None:
    """End the run (one line) once train.max_consecutive_skips steps in a row were skipped. Each step's count
    is read once it is ready, without waiting for it (`wait`: at a step whose metrics are read anyway)."""
    run.pending.append((step, metrics["consecutive_skips"]))
    limit = run.cfg.train.max_consecutive_skips
    while run.pending and (wait or run.pending[0][1].is_ready()):
        at, count = run.pending.pop(0)
        if int(count) >= limit:
            raise TrainingDiverged(f"{int(count)} steps in a row skipped through step {at} (train.max_consecutive_"
                                   f"skips={limit}): non-finite or spiking losses; lower train.lr, raise train."
                                   f"warmup_steps, or check the data; {_resume_point(run)}")


def _evaluate(run: _Run, params) -> dict:
    """The validation row: the loss over the validation batches (their summed terms over their summed count) and
    a sequence objective's metrics likewise (DPO's rewards), each named `val_` + its name; a mixture's loss of each
    source besides (`val_loss/NAME`), the loss over all of them pooled."""
    scored = (params,) if run.cfg.train.objective == "dpo" else ()  # the reference scores each batch
    if not hasattr(run.data, "eval_sources"):
        return {f"val_{k}": v for k, v in _mean_terms(run, params, run.data.eval_batches(run.fns.batch_sharding,
                                                                                          *scored)).items()}
    row, pooled = {}, {"sums": {}, "count": 0.0}
    for name, batches in run.data.eval_sources(run.fns.batch_sharding).items():
        mean = _mean_terms(run, params, batches, pooled)
        row[f"val_loss/{name}"] = mean["loss"]
    return {**{f"val_{k}": v / pooled["count"] for k, v in pooled["sums"].items()}, **row}


def _mean_terms(run: _Run, params, batches, pooled: dict | None = None) -> dict:
    """The loss and metric sums of `batches` over their count (and added to `pooled`'s)."""
    sums, count = {}, 0.0
    for vb in batches:
        s, c, ms = jax.device_get(run.eval_fn(params, vb))
        for k, v in {"loss": s, **ms}.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        count += float(c)
    if pooled is not None:
        for k, v in sums.items():
            pooled["sums"][k] = pooled["sums"].get(k, 0.0) + v
        pooled["count"] += count
    return {k: v / count for k, v in sums.items()}


def _benchmarks(run: _Run, step: int, params) -> None:
    """Score the benchmark tasks (train.eval_tasks): a metrics row `eval/TASK/METRIC`, the console table, and
    RUN_DIR/eval/step_N.json with every request's log-likelihood."""
    results, samples = eval_run.evaluate_all(run.tasks, run.tokenizer, run.fns, params, run.cfg)
    if run.writer:
        run.writer.write({"step": step, **{f"eval/{name}/{m}": v for name, ms in results.items()
                                           for m, v in ms.items()}})
        for name, ms in results.items():
            _show(run, f"step {step:>6} | {name}: " + ", ".join(f"{m} {v:.4f}" for m, v in ms.items()))
        os.makedirs(os.path.join(run.cfg.run.dir, "eval"), exist_ok=True)
        with open(os.path.join(run.cfg.run.dir, "eval", f"step_{step}.json"), "w") as f:
            json.dump({"step": step, "results": results, "samples": samples}, f, indent=1)


def _save(run: _Run, step: int, state, applied: bool = True) -> None:
    """Save step `step`; `applied`: its update was not skipped, so its loss was a finite one."""
    if run.mngr is None:
        run.mngr = ckpt.open_manager(run.cfg.run.dir, run.cfg.train.keep_checkpoints)
    faults.before_save(run.mngr, step)
    meta = {"config": to_dict(run.cfg), "step": step, "state_fields": list(state_lib.FIELDS)}
    if hasattr(run.data, "stages"):  # a mixture's weights through the run (they may change at a resume)
        meta["data_stages"] = run.data.stages
    ckpt.save(run.mngr, step, _stored(run.cfg, state), meta, checked=run.cfg.train.checkpoint_checksums)
    if applied:  # its row was checked finite first
        run.good_checkpoint = step
    faults.after_save(run.mngr, step)


def _batch(run: _Run, step: int, state):
    """The batch of step `step` (0-based); a GRPO run's is sampled from the current parameters, a DPO run's scored
    by the reference (under LoRA, the current parameters with their adapters off)."""
    if run.cfg.train.objective in ("grpo", "dpo"):
        return run.data.train_batch(step, run.fns.batch_sharding, state.params)
    return run.data.train_batch(step, run.fns.batch_sharding)


def _at_boundary(cfg: Config, step: int) -> bool:
    """Whether a run may stop after step `step`: not between the updates of one batch of GRPO rollouts,
    which a resumed run could not sample again (a stop asked for there waits for the batch's last update)."""
    return cfg.train.objective != "grpo" or step % cfg.rl.num_iterations == 0


def _finished(x) -> bool:
    """Whether a step's output is computed (one fetched to the host is)."""
    return not isinstance(x, jax.Array) or x.is_ready()


def _dispatch(run: _Run, step: int, state, previous):
    """Make step `step`'s batch and dispatch the step: (state, metrics), both still computing. Making the batch
    counts as data time unless the previous step (its loss: `previous`) was still running when it was made."""
    with run.clock.timing("data") as part:
        batch = _batch(run, step - 1, state)
        if previous is not None and not _finished(previous):
            part.category = "step"  # hidden: the devices were busy
    state, metrics = run.step_fn(state, faults.corrupt(step, batch))
    faults.after_dispatch(step, run.mngr)
    return state, metrics


def _log_step(run: _Run, step: int, metrics, write: bool) -> dict:
    """Step `step`'s row (its metrics on the host), written to the metrics when `write`, with the time since
    the last row (`time/*`, read as the step finished) and memory."""
    now, (mark_time, mark_step) = time.time(), run.since
    columns = {**run.clock.lap(), **metrics_lib.memory_columns()} if write else {}
    with run.clock.timing("log"):
        row = _metrics_row(run, step, metrics, (now - mark_time) / (step - mark_step), mark_step)
        if write:
            run.since = (now, step)
            _write_row(run, {**row, **columns})
    return row


@contextlib.contextmanager
def _not_training(run: _Run, category: str):
    """Time `category`'s block, and take it out of the step time of the next row (`step_time_s`)."""
    start = time.time()
    with run.clock.timing(category):
        yield
    run.since = (run.since[0] + time.time() - start, run.since[1])


def _validate(run: _Run, step: int, state) -> None:
    """The validation loss (and its row) and the benchmark tasks."""
    with _not_training(run, "eval"):
        if run.eval_fn is not None:
            val = _evaluate(run, run.fns.device_params(state.params))
            run.last["val_loss"] = val["val_loss"]
            if run.writer:
                run.writer.write({"step": step, **val})
                _show(run, f"step {step:>6} | val_loss {val['val_loss']:.4f}" + _preference_text(val, "val_"))
        if run.tasks:
            _benchmarks(run, step, run.fns.device_params(state.params))


def _train_steps(run: _Run, state, start: int, should_stop):
    """Steps start+1 .. train.steps: log, evaluate and checkpoint as configured; on a stop request save
    this step and raise Stopped."""
    t, clock, previous, pending = run.cfg.train, run.clock, None, None
    run.since = (time.time(), start)
    for step in range(start + 1, t.steps + 1):
        with clock.timing("profile"):
            run.profiler.before(step, run.step_fn)
        # step time, but for making the batch; it ends once the last state is dropped (freeing it takes time)
        with clock.timing("step"), jax.profiler.StepTraceAnnotation("train", step_num=step):
            state, metrics = _dispatch(run, step, state, previous)
            previous = metrics["loss"]
        with clock.timing("step"):
            pending = pending or should_stop(step)  # asked every step: several processes agree on the step
        signum = pending if _at_boundary(run.cfg, step) else None
        saving = signum is not None or (t.checkpoint_every > 0 and (step % t.checkpoint_every == 0 or step == t.steps))
        logging_now = step == start + 1 or step % max(t.log_every, 1) == 0 or step == t.steps or signum is not None
        fetched = logging_now or saving or run.profiler.due(step)
        if fetched:
            with clock.timing("step"):
                metrics = jax.device_get(metrics)  # waits for the step
        if logging_now or saving:  # a checkpoint is saved only after its loss was seen finite
            row = _log_step(run, step, metrics, write=logging_now)
            _check_finite(run, row)
        with clock.timing("step"):
            _watch_skips(run, step, metrics, wait=fetched)
        with clock.timing("profile"):
            if run.profiler.due(step):
                run.profiler.stop()
        if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
            _validate(run, step, state)
        if saving:
            with _not_training(run, "checkpoint"):
                _save(run, step, state, applied=not row.get("skipped"))
        if run.bar:
            with clock.timing("log"):
                run.bar.update(1)
                run.bar.set_postfix(loss=f"{run.last['loss']:.3f}")
        if signum is not None:
            raise Stopped(f"{signal.Signals(signum).name} at step {step}: checkpoint saved in "
                          f"{ckpt.checkpoint_dir(run.cfg.run.dir)}; continue with train.resume=true "
                          f"run.dir={run.cfg.run.dir}", 128 + signum)
    return state


def _compile(run: _Run, state, start: int) -> None:
    """The train (and evaluation) step, compiled for the loader's first batch; a GRPO run's first batch is
    sampled from the parameters (and checked when made), so its step is compiled for the batch's shapes."""
    cfg, fns, data = run.cfg, run.fns, run.data
    grpo = cfg.train.objective == "grpo"
    scored = (state.params,) if cfg.train.objective == "dpo" else ()
    with run.clock.timing("data"):
        batch = (fns.abstract_batch(cfg.train.global_batch, cfg.model.seq_len) if grpo
                 else data.train_batch(start, fns.batch_sharding, *scored))
    batch_lib.check(batch, fns.objective.fields)  # a batch the step cannot take is one line, before compiling
    t0 = time.time()
    with run.clock.timing("compile"), faults.compiling():
        run.step_fn = fns.train_step.lower(state, batch).compile()
        evaluating = cfg.train.eval_every and data.has_validation
        run.eval_fn = fns.eval_loss.lower(fns.device_params(state.params), batch).compile() if evaluating else None
    log.info("compiled the train step in %.1f s", time.time() - t0)


def _set_up(cfg: Config, clock: goodput.Clock):
    """Everything before the run directory is written: (the run without its programs, its starting state, its
    starting step, whether it resumes, the prefetching data or None). A problem with the user's input ends here."""
    with clock.timing("data"):
        tokenizer, shape, notes, data = prepare(cfg)
        # a bad task file writes nothing
        tasks = [eval_tasks.load_task(path, "train.eval_tasks") for path in cfg.train.eval_tasks]
    if not cfg.run.dir and jax.process_count() > 1:
        raise ConfigError("run.dir: a multi-process run needs it set explicitly (the same shared path on every host)")
    if not cfg.run.dir:
        cfg.run.dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    resume = _check_run_dir(cfg)
    barrier("jaxllm_run_dir_checked")  # every process has looked at run.dir before process 0 writes to it
    fns, t, ahead = make_step_fns(cfg, make_mesh(shape, cfg)), cfg.train, None
    # the starting state is read before anything is written (a checkpoint that cannot be read writes nothing)
    with clock.timing("checkpoint" if resume else "setup"):
        state, start, meta = _restore(cfg, fns) if resume else (initial_state(cfg, fns), 0, {})
    if hasattr(data, "resume_stages") and resume:  # a mixture's weights so far, and new ones from here
        notes = notes + data.resume_stages(meta, start)
    if t.objective == "grpo":  # the batches come from the policy's own samples
        data = RolloutBatches(cfg, tokenizer, data, fns, reference_params(cfg, fns) if cfg.rl.beta else None, clock)
    elif cfg.data.prefetch:  # built ahead on a thread (from the first batch asked for), from step `start` on
        data = ahead = prefetch.Prefetched(data, fns.batch_sharding, start, cfg.data.prefetch)
    if t.objective == "dpo":  # each batch scored by the reference before the step, if the loss reads it
        scoring = "ref_logp" in fns.objective.fields
        data = preference.Scored(data, fns, reference_params(cfg, fns) if scoring else None)
    _log_setup(cfg, shape, notes, data, fns)
    run = _Run(cfg, fns, data, None, None, tasks=tasks, tokenizer=tokenizer, clock=clock,
               profiler=profiling.Profiler(cfg, start), good_checkpoint=start if resume else None)
    return run, state, start, resume, ahead


def _open_run_dir(run: _Run, resume: bool, start: int) -> None:
    """Write the run directory (process 0): its config, metrics.jsonl cut back to the restored step, the W&B run."""
    cfg, made = run.cfg, not os.path.isdir(run.cfg.run.dir)
    os.makedirs(cfg.run.dir, exist_ok=True)
    if jax.process_index() != 0:
        return
    try:
        run.wandb = wandb_log.open_run(cfg, to_dict(cfg), resumed=resume)
    except UserError:
        if made:  # nothing half-written
            shutil.rmtree(cfg.run.dir, ignore_errors=True)
        raise
    with open(os.path.join(cfg.run.dir, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    if cfg.train.resume:  # the steps after the restored one are trained (and logged) again
        metrics_lib.keep_rows_through(cfg.run.dir, start)


def _open_metrics(run: _Run, start: int) -> None:
    """Once the step compiled (a run killed before leaves no metrics.jsonl, so it is not a run to resume): the
    metrics writer with its views (process 0), the progress bar."""
    cfg = run.cfg
    if jax.process_index() != 0:
        return
    run.writer = metrics_lib.MetricsWriter(cfg.run.dir, resumed=cfg.train.resume, wandb=run.wandb)
    if cfg.run.progress:
        from tqdm import tqdm

        run.bar = tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", file=sys.stderr,
                       dynamic_ncols=True)


def _close(run: _Run, failed: bool) -> None:
    """Close what the run opened: the progress bar, the metrics (W&B records `failed`), the profiler, and the
    checkpoints once their async saves are written."""
    with run.clock.timing("log"):
        if run.bar:
            run.bar.close()
        if run.writer:
            run.writer.close(failed)  # and the W&B run
        elif run.wandb:
            run.wandb.close(failed)
    with run.clock.timing("profile"):
        run.profiler.stop()
    if run.mngr is not None:
        with run.clock.timing("checkpoint"):
            run.mngr.wait_until_finished()
            run.mngr.close()


def train(cfg: Config) -> dict:
    """Run training as configured. Returns a summary (final losses, run dir, goodput, ...)."""
    clock = goodput.Clock()
    with clock.timing("setup"):
        initialize_distributed(cfg.distributed)
        run, state, start, resume, ahead = _set_up(cfg, clock)
        _open_run_dir(run, resume, start)  # from here on the run directory is written
    if resume:
        log.info("resumed from step %d in %s", start, cfg.run.dir)
    # from here a signal stops the run at a step; the prefetching thread stops with the run, however it ends
    with preemption.stop_requests() as should_stop, contextlib.closing(ahead) if ahead else contextlib.nullcontext():
        try:
            _compile(run, state, start)
            with clock.timing("setup"):
                run.flops_per_token, run.peak = flops_per_token(cfg), peak_flops(cfg)
                _open_metrics(run, start)
            state = _train_steps(run, state, start, should_stop)
        finally:
            _close(run, failed=sys.exc_info()[0] is not None)
    return _finish(cfg, run, state, jax.process_index() == 0)


def _finish(cfg: Config, run: _Run, state, lead: bool) -> dict:
    """Goodput, the loss plot and the end-of-run sample; the run's summary."""
    summary = {"run_dir": cfg.run.dir, "steps": cfg.train.steps, "loss": run.last["loss"],
               "val_loss": run.last["val_loss"], "time": run.clock.summary()}
    log.info(goodput.summary_text(summary["time"]))
    if lead:
        summary["plot"] = metrics_lib.plot_metrics(cfg.run.dir)
        log.info("loss curves: %s", summary["plot"])
    if cfg.run.sample_tokens > 0:
        text = sample(run.fns.device_params(state.params), cfg, run.tokenizer, cfg.run.sample_prompt,
                      cfg.run.sample_tokens, on=run.fns)
        summary["sample"] = text
        if lead:
            with open(os.path.join(cfg.run.dir, "sample.txt"), "w") as f:
                f.write(text)
            log.info("sample:\n%s\n", text)
    return summary
