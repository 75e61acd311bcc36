"""`python -m tools.bench.generate`: greedy decode speed of jaxllm's KV-cache generation, against the same
model run without a cache and against transformers' `generate`, on one CPU process.

The model: a random LLaMA-shaped model built by transformers (default hidden 512, 8 layers, 8 query heads
sharing 4 KV heads, intermediate 1408, vocabulary 32,000, untied head; ~56M parameters; weights normal
std 0.02 from seed 0, norm weights 1), saved with `save_pretrained` in fp32 into a temporary directory
(or --dir) and imported by jaxllm (`interop.hf.config_for` + `load_params`, precision.compute = float32).
Every path reads those same files. The prompts are random token ids (seed 0), --prompt tokens each, one
per row; every path decodes --new tokens greedily (fp32) for batch 1 and batch 4 (--batches):

- **cache**: `jaxllm.generate.generate_arrays(params, cfg, prompts, N, temperature=0.0)`: prefill, then
  N-1 decode steps against the KV cache, in one compiled program; host arrays out.
- **no cache**: one jitted function over a fixed [batch, prompt + N] token buffer: `transformer.embed`,
  `blocks`, `head_logits` (the training forward, under `jax.default_matmul_precision("highest")` as
  generation's fp32 is) at positions 0.. with segment ids 1 for the tokens so far and 0 for the rest;
  logits at the last filled position only; the argmax is written into the buffer on the device. Called N
  times from a Python loop, each call re-running the whole buffer.
- **transformers**: `AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)` and
  `model.generate(input_ids, attention_mask, do_sample=False, max_new_tokens=N, min_new_tokens=N)`
  (its dynamic KV cache; torch.set_num_threads(the cores this process may use, or --torch-threads)). The
  generation config's EOS id is cleared, so `min_new_tokens` suppresses no token and greedy is plain argmax,
  as in jaxllm.

How it is timed: each path runs once untimed first (the warm-up; for the jaxllm paths it compiles: the
compile time reported is the time JAX's own monitoring events record for tracing, lowering and XLA
compilation during that call); then --repeats rounds, each timing every path once in rotated order (so
no path always runs first under a shared machine's changing load); the median is reported. Each timed
call ends with host arrays (tokens). tokens/s = N · batch / time. Ratios: cache / no cache and cache /
transformers. Agreement: how many of the N · batch greedy tokens of each path equal the cache path's,
and the first step at which a row differs (a path with the same model and greedy argmax should agree on
all of them unless two logits are within rounding of each other).

Prints a Markdown table (and the machine); with --json, one more line: a JSON object of everything.
About 1.5-3 minutes on 2 CPU cores with the defaults (the no-cache path at batch 4 takes most of it); the
process's peak resident set is printed. Throughput on a shared machine moves with other processes' load
(torch's 2-thread small matmuls most of all): compare the ratios, which come from interleaved calls.

    PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python -m tools.bench.generate --json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]  # what JAX's monitoring events record, summed; reset around each warm-up


# ---------------------------------------------------------------- the model


def make(path: str, a) -> None:
    """Write the random LLaMA-shaped fp32 model to `path` with transformers' save_pretrained."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(path)


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, length).tolist() for _ in range(batch)]  # 0-2: pad/bos/eos ids


# ---------------------------------------------------------------- the three paths


def jaxllm_model(path: str, length: int):
    from jaxllm.interop import hf

    cfg = hf.config_for(path, {"precision.compute": "float32", "model.seq_len": length})
    return cfg, hf.load_params(path, cfg.model)


def cache_path(params, cfg, prompts, new: int):
    """A callable: one greedy generation with the KV cache -> tokens [batch, new]."""
    from jaxllm.generate import generate_arrays

    return lambda: generate_arrays(params, cfg, prompts, new, temperature=0.0)["tokens"]


def _no_cache_step(params, tokens, n, *, m):
    """Greedy next token from the whole buffer; written at slot n (n = tokens so far)."""
    import jax
    import jax.numpy as jnp

    from jaxllm.models import transformer

    with jax.default_matmul_precision("highest"):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        segment_ids = (positions < n).astype(jnp.int32)
        x = transformer.embed(params, tokens, positions, m, jnp.float32)
        x, _ = transformer.blocks(params["blocks"], x, positions, segment_ids, m, jnp.float32)
        last = jax.lax.dynamic_slice_in_dim(x, n - 1, 1, axis=1)
        logits = transformer.head_logits(params, last, m, jnp.float32)[:, 0, :m.vocab_size]
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], n, axis=1)


def no_cache_path(params, cfg, prompts, new: int):
    """A callable: N calls of the jitted full-buffer forward -> tokens [batch, new]."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    step = jax.jit(functools.partial(_no_cache_step, m=cfg.model))
    start = len(prompts[0])
    buffer = np.zeros((len(prompts), start + new), np.int32)
    buffer[:, :start] = prompts

    def run():
        tokens = jnp.asarray(buffer)
        for i in range(new):
            tokens = step(params, tokens, jnp.int32(start + i))
        return np.asarray(tokens)[:, start:]

    return run


@functools.cache
def hf_model(path: str):
    """transformers' fp32 model of the files (loaded once, for every batch size)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # min_new_tokens would otherwise suppress the EOS id
    return model


def transformers_path(path: str, prompts, new: int):
    """A callable: transformers' greedy `generate` -> tokens [batch, new]."""
    import torch

    model = hf_model(path)
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0)
        return out[:, ids.shape[1]:].numpy()

    return run


# ---------------------------------------------------------------- timing


def _on_event(event: str, seconds: float, **_) -> None:
    if event in COMPILE_EVENTS:
        _compile_seconds[0] += seconds


def warm_up(run) -> tuple[float, float]:
    """(seconds of the first call, of it the seconds JAX spent tracing, lowering and compiling)."""
    _compile_seconds[0] = 0.0
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0, _compile_seconds[0]


def timed(runs: dict, repeats: int) -> tuple[dict, dict]:
    """({path: [seconds of each timed call]}, {path: the tokens of its last call}), rounds in rotated order."""
    seconds, tokens = {k: [] for k in runs}, {}
    names = list(runs)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            tokens[name] = runs[name]()
            seconds[name].append(time.perf_counter() - t0)
    return seconds, tokens


def agreement(tokens, reference) -> dict:
    """How many tokens equal the reference's, and the first step at which any row differs (None: none does)."""
    import numpy as np

    same = np.asarray(tokens) == np.asarray(reference)
    differs = np.nonzero(~same.all(axis=0))[0]
    return {"agree": int(same.sum()), "of": int(same.size), "first_difference": int(differs[0]) if differs.size
            else None}


def bench_batch(path: str, params, cfg, a, batch: int) -> dict:
    """Every path at one batch size: warm-up, timed rounds, tokens/s, agreement with the cache path."""
    prompts = prompts_for(batch, a.prompt, a.vocab)
    runs = {"cache": cache_path(params, cfg, prompts, a.new), "no cache": no_cache_path(params, cfg, prompts, a.new),
            "transformers": transformers_path(path, prompts, a.new)}
    first = {name: warm_up(run) for name, run in runs.items()}
    seconds, tokens = timed(runs, a.repeats)
    out = {"batch": batch, "paths": {}}
    for name in runs:
        median = statistics.median(seconds[name])
        out["paths"][name] = {"seconds": median, "tokens_per_s": a.new * batch / median, "runs": seconds[name],
                              "first_call": first[name][0], "compile": first[name][1] if name != "transformers"
                              else None, **agreement(tokens[name], tokens["cache"])}
    p = out["paths"]
    out["cache_over_no_cache"] = p["cache"]["tokens_per_s"] / p["no cache"]["tokens_per_s"]
    out["cache_over_transformers"] = p["cache"]["tokens_per_s"] / p["transformers"]["tokens_per_s"]
    out["tokens"] = {name: t.tolist() for name, t in tokens.items()}
    return out


# ---------------------------------------------------------------- report


def machine() -> dict:
    import jax
    import numpy as np
    import torch
    import transformers

    import resource

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "jax_devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
            "jax": jax.__version__, "numpy": np.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def table(results: list[dict]) -> str:
    rows = ["| batch | path | tokens/s | time for N tokens | first call (compile) | greedy tokens = cache's |",
            "|---:|---|---:|---:|---:|---|"]
    for r in results:
        for name, p in r["paths"].items():
            compile_ = f" ({p['compile']:.2f} s)" if p["compile"] is not None else ""
            diff = "" if p["first_difference"] is None else f", first differs at step {p['first_difference']}"
            rows.append(f"| {r['batch']} | {name} | {p['tokens_per_s']:.1f} | {p['seconds'] * 1e3:.0f} ms | "
                        f"{p['first_call']:.2f} s{compile_} | {p['agree']}/{p['of']}{diff} |")
        rows.append(f"| {r['batch']} | **cache / no cache** | **{r['cache_over_no_cache']:.2f}×** | | | |")
        rows.append(f"| {r['batch']} | **cache / transformers** | **{r['cache_over_transformers']:.2f}×** | | | |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row (default 32)")
    p.add_argument("--new", type=int, default=64, help="new tokens N (default 64)")
    p.add_argument("--batches", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default 3)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch's threads (default 0: the cores this process "
                   "may use)")
    p.add_argument("--dir", default=None, help="write (or reuse) the model here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="also print one JSON line of everything")
    a = p.parse_args(argv)
    if a.prompt < 1 or a.new < 1 or a.repeats < 1:
        sys.exit("error: --prompt, --new and --repeats must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        run(a.dir or tmp, a)


def run(path: str, a) -> None:
    import jax
    import torch
    import transformers

    torch.set_num_threads(a.torch_threads or len(os.sched_getaffinity(0)))
    transformers.utils.logging.disable_progress_bar()
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(path, "config.json")):
        make(path, a)
    cfg, params = jaxllm_model(path, a.prompt + a.new)
    m = cfg.model
    if (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size) != (
            a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab):
        sys.exit(f"error: {path} holds another model (hidden {m.d_model}, {m.n_layers} layers, {m.n_heads} heads / "
                 f"{m.n_kv_heads} KV, intermediate {m.d_ff}, vocab {m.vocab_size}); give its sizes or a new --dir")
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"model: {n_params / 1e6:.1f}M parameters (hidden {a.hidden}, {a.layers} layers, {a.heads} heads / "
          f"{a.kv_heads} KV, intermediate {a.intermediate}, vocab {a.vocab}), fp32; prompt {a.prompt}, "
          f"N = {a.new} new tokens, greedy; made and imported in {time.perf_counter() - t0:.1f} s", flush=True)
    load, results = [os.getloadavg()[0]], []
    for batch in (int(b) for b in a.batches.split(",") if b):
        results.append(bench_batch(path, params, cfg, a, batch))
        load.append(os.getloadavg()[0])
        print(f"batch {batch} done at {time.perf_counter() - t0:.0f} s", flush=True)
    report(results, a, n_params, load, time.perf_counter() - t0)


def report(results: list[dict], a, n_params: int, load: list[float], seconds: float) -> None:
    """The Markdown table, the machine and (with --json) the JSON line."""
    m = machine()
    print("\n" + table(results) + "\n")
    print(f"machine: {m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}, JAX devices "
          f"{len(m['jax_devices'])}); Python {m['python']}, jax {m['jax']}, torch {m['torch']}, transformers "
          f"{m['transformers']}; peak RSS {m['peak_rss_gib']:.2f} GiB; load average (1 min) "
          f"{' -> '.join(f'{x:.1f}' for x in load)}; total {seconds:.0f} s")
    if a.json:
        model = {k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")}
        print(json.dumps({"model": model | {"params": n_params}, "prompt": a.prompt, "new": a.new,
                          "repeats": a.repeats, "results": results, "machine": m, "load_average": load}))


if __name__ == "__main__":
    main()
