"""The training loop: set up, train with logging/eval/checkpoints, then plot and sample.

Everything that can fail because of the user's input (config, data, an existing run
directory, a checkpoint that does not fit) is checked before the run directory is
written to. Host syncs happen only at log, eval and checkpoint steps.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import data as data_lib
from jaxllm.config import Config, to_dict, to_toml, validate
from jaxllm.errors import ConfigError
from jaxllm.mesh import barrier, initialize_distributed, make_mesh
from jaxllm.models import transformer
from jaxllm.parallel.pipeline_schedules import bubble_formula, bubble_fraction
from jaxllm.train import checkpoint as ckpt
from jaxllm.train import metrics as metrics_lib
from jaxllm.train.step import make_step_fns

log = logging.getLogger("jaxllm")


def resolve(cfg: Config):
    """Fill `model.vocab_size` from the tokenizer and validate against the devices.

    Returns (tokenizer, mesh shape, notes to log); raises UserError on any problem.
    """
    tokenizer = data_lib.get_tokenizer(cfg.data.tokenizer)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.vocab_size
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the {tokenizer.name} tokenizer's "
                          f"{tokenizer.vocab_size}; raise it or set 0")
    shape, notes = validate(cfg, jax.device_count())
    return tokenizer, shape, notes


def prepare(cfg: Config):
    """`resolve`, then load the data: (tokenizer, mesh shape, notes, corpus)."""
    tokenizer, shape, notes = resolve(cfg)
    corpus = data_lib.load_corpus(cfg.data.source, tokenizer, cfg.data.val_percent)
    for name, stream in (("train", corpus.train), ("validation", corpus.val)):
        if len(stream) < cfg.model.seq_len + 1:
            raise ConfigError(f"data.source: the {name} split has {len(stream)} tokens, fewer than model.seq_len+1="
                              f"{cfg.model.seq_len + 1}; use more data or a shorter model.seq_len")
    return tokenizer, shape, notes, corpus


def _check_run_dir(cfg: Config) -> int | None:
    """The checkpoint step to resume from (None: fresh start); refuse to overwrite another run."""
    step = ckpt.latest_step(cfg.run.dir)
    if cfg.train.resume:
        return step
    used = [n for n in ("metrics.jsonl", "checkpoints") if os.path.exists(os.path.join(cfg.run.dir, n))]
    if used:
        raise ConfigError(f"run.dir '{cfg.run.dir}' already holds a run; set train.resume=true to continue it "
                          "or choose another run.dir")
    return None


def _check_resumable(cfg: Config, meta: dict) -> None:
    saved = meta.get("config", {})
    for section in ("model", "train.optimizer"):
        part, _, key = section.partition(".")
        a, b = saved.get(part, {}), to_dict(cfg)[part]
        if key:
            a, b = a.get(key), b.get(key)
        if a != b:
            raise ConfigError(f"run.dir '{cfg.run.dir}' was trained with different {section} settings; "
                              "resume with the same ones or choose another run.dir")


def flops_per_token(cfg: Config) -> float:
    m = cfg.model
    n = transformer.count_params(m, embeddings=False, active=True) + m.d_model * m.vocab_size  # + LM head matmul
    return metrics_lib.model_flops_per_token(n, m.n_layers, m.seq_len, m.d_model)


def peak_flops(cfg: Config) -> float:
    """Peak FLOP/s of all devices together; on CPU a matmul in the compute dtype measured now
    (fake devices share the same cores, so it is not multiplied by their count)."""
    dev = jax.devices()[0]
    peak = metrics_lib.peak_flops_per_device(dev, "bfloat16")  # MFU's convention: the chip's bf16 peak
    if peak is None:
        return metrics_lib.measure_matmul_peak(jnp.dtype(cfg.precision.compute))
    return peak * jax.device_count()


def sample(params, cfg: Config, tokenizer, prompt: str, n_tokens: int, seed: int = 0) -> str:
    """Generate `n_tokens` after `prompt` (temperature 0.8), re-running the model on a window each token."""
    m, dtype = cfg.model, jnp.dtype(cfg.precision.compute)
    T = m.seq_len
    logits_fn = jax.jit(lambda p, buf: transformer.logits_at(p, buf, m, dtype))
    ids = list(tokenizer.encode(prompt)) or [tokenizer.eot]
    key = jax.random.key(seed)
    for _ in range(n_tokens):
        window = ids[-T:]
        buf = np.zeros((1, T), np.int32)
        buf[0, : len(window)] = window
        logits = logits_fn(params, jnp.asarray(buf))[0, len(window) - 1, : m.vocab_size]
        key, sub = jax.random.split(key)
        nxt = int(jax.random.categorical(sub, logits / 0.8))
        if nxt >= tokenizer.vocab_size or nxt == tokenizer.eot:
            break
        ids.append(nxt)
    return tokenizer.decode(np.asarray(ids, np.uint32))


def train(cfg: Config) -> dict:
    """Run training as configured. Returns a summary (final losses, run dir, ...)."""
    initialize_distributed(cfg.distributed)
    tokenizer, shape, notes, corpus = prepare(cfg)
    if not cfg.run.dir and jax.process_count() > 1:
        raise ConfigError("run.dir: a multi-process run needs it set explicitly (the same shared path on every host)")
    if not cfg.run.dir:
        cfg.run.dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    resume_step = _check_run_dir(cfg)
    barrier("jaxllm_run_dir_checked")  # every process has looked at run.dir before process 0 writes to it
    lead = jax.process_index() == 0
    mesh = make_mesh(shape, cfg)
    fns = make_step_fns(cfg, mesh)
    t = cfg.train

    mngr = None
    state, start = None, 0
    if resume_step is not None:
        mngr = ckpt.open_manager(cfg.run.dir, t.keep_checkpoints)
        state, meta = ckpt.restore(mngr, fns.abstract_state, resume_step)
        _check_resumable(cfg, meta)
        start = int(state["step"])
        if start >= t.steps:
            raise ConfigError(f"run.dir '{cfg.run.dir}' is already at step {start} >= train.steps={t.steps}; "
                              "raise train.steps to train further")

    # From here on the run directory is written.
    os.makedirs(cfg.run.dir, exist_ok=True)
    if lead:
        with open(os.path.join(cfg.run.dir, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
    mesh_desc = " ".join(f"{a}={n}" for a, n in shape.items() if n > 1) or "1 device"
    log.info("mesh: %s over %d %s device(s); %s", mesh_desc, jax.device_count(), jax.devices()[0].platform, corpus.description)
    for note in notes:
        log.info(note)
    n_params = transformer.count_params(cfg.model)
    log.info("model: %s, %.2fM parameters; zero_stage=%d, microbatches=%d, compute %s",
             cfg.model.family, n_params / 1e6, t.zero_stage, t.microbatches, cfg.precision.compute)
    if fns.schedule is not None:
        s = fns.schedule
        log.info("pipeline: %s over %d stages × %d chunk(s), %d microbatches, %d ticks; bubble %.1f%% of the "
                 "table (formula %.1f%%); %d stage input(s) buffered", s.name, s.stages, s.chunks, s.microbatches,
                 s.ticks, 100 * bubble_fraction(s), 100 * bubble_formula(s), s.act_depth)
    if state is None:
        state = fns.init(t.seed)
    else:
        log.info("resumed from step %d in %s", start, cfg.run.dir)
    if mngr is None and t.checkpoint_every > 0:
        mngr = ckpt.open_manager(cfg.run.dir, t.keep_checkpoints)

    def batch(step: int):
        return data_lib.global_batch(corpus.train, t.seed, step, t.global_batch, cfg.model.seq_len, fns.batch_sharding)

    t0 = time.time()
    step_fn = fns.train_step.lower(state, batch(start)).compile()
    eval_fn = fns.eval_loss.lower(state["params"], batch(start)).compile() if t.eval_every else None
    log.info("compiled the train step in %.1f s", time.time() - t0)
    tokens_per_step = t.global_batch * cfg.model.seq_len
    fpt, peak = flops_per_token(cfg), peak_flops(cfg)

    def evaluate() -> float:
        total, count = 0.0, 0.0
        for i in range(t.eval_batches):
            vb = data_lib.eval_batch(corpus.val, i, t.eval_batches, t.global_batch, cfg.model.seq_len, fns.batch_sharding)
            s, c = eval_fn(state["params"], vb)
            total, count = total + float(s), count + float(c)
        return total / count

    writer = metrics_lib.MetricsWriter(cfg.run.dir) if lead else None
    bar = None
    if lead and cfg.run.progress:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    last = {"loss": math.nan, "val_loss": math.nan}
    mark_time, mark_step = time.time(), start
    try:
        for step in range(start + 1, t.steps + 1):
            state, metrics = step_fn(state, batch(step - 1))
            if step == start + 1 or step % max(t.log_every, 1) == 0 or step == t.steps:
                metrics = jax.device_get(metrics)
                now = time.time()
                dt = (now - mark_time) / (step - mark_step)
                mark_time, mark_step = now, step
                row = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
                       "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_step / dt,
                       "step_time_s": dt, "mfu": metrics_lib.mfu(tokens_per_step / dt, fpt, peak)}
                row.update({k: float(v) for k, v in metrics.items() if k.startswith("moe_") and k != "moe_load"})
                # each expert's share of the routed pairs, one column per expert
                row.update({f"moe_load_{e}": float(v) for e, v in enumerate(metrics.get("moe_load", []))})
                last["loss"] = row["loss"]
                if writer:
                    writer.write(row)
                    msg = (f"step {step:>6} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad_norm "
                           f"{row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s | {dt * 1e3:.0f} ms | "
                           f"mfu {row['mfu'] * 100:.1f}%")
                    if "moe_balance" in row:
                        msg += (f" | moe balance {row['moe_balance']:.3f} z {row['moe_z']:.2f} load max/mean "
                                f"{row['moe_load_max_over_mean']:.2f} dropped {row['moe_dropped'] * 100:.1f}%")
                    bar.write(msg) if bar else log.info(msg)
                if not math.isfinite(row["loss"]):
                    raise FloatingPointError(f"loss is {row['loss']} at step {step}; lower train.lr or check the data")
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                last["val_loss"] = evaluate()
                if writer:
                    writer.write({"step": step, "val_loss": last["val_loss"]})
                    msg = f"step {step:>6} | val_loss {last['val_loss']:.4f}"
                    bar.write(msg) if bar else log.info(msg)
                mark_time = time.time()  # evaluation is not training time
            if mngr is not None and (step % t.checkpoint_every == 0 or step == t.steps):
                ckpt.save(mngr, step, state, {"config": to_dict(cfg), "step": step})
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}")
    finally:
        if bar:
            bar.close()
        if writer:
            writer.close()
        if mngr is not None:
            mngr.wait_until_finished()
            mngr.close()

    summary = {"run_dir": cfg.run.dir, "steps": t.steps, "loss": last["loss"], "val_loss": last["val_loss"]}
    if lead:
        summary["plot"] = metrics_lib.plot_metrics(cfg.run.dir)
        log.info("loss curves: %s", summary["plot"])
    if cfg.run.sample_tokens > 0:
        text = sample(state["params"], cfg, tokenizer, cfg.run.sample_prompt, cfg.run.sample_tokens)
        summary["sample"] = text
        if lead:
            with open(os.path.join(cfg.run.dir, "sample.txt"), "w") as f:
                f.write(text)
            log.info("sample:\n%s\n", text)
    return summary
