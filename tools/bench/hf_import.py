"""`python -m tools.bench.hf_import DIR`: time and host memory of importing a Hugging Face checkpoint, jaxllm
against transformers' own `from_pretrained` of the same files.

`python -m tools.bench.hf_import --make DIR` first writes the checkpoint the benchmark is about: a
LLaMA-3.2-1B-shaped model (hidden 2048, 16 layers, 32 query heads sharing 8 KV heads, intermediate 8192,
vocabulary 128,256, tied embeddings, llama3 RoPE scaling) with random weights (normal, std 0.02; norm
weights 1), in bfloat16, saved by transformers' `save_pretrained` in 3 safetensors shards with their index
(~2.5 GB). The model is built on the meta device, given empty storage and cast to bf16 before it is
filled (seed 0: the files are the same every time); making it takes ~20 s and peaks at ~3.3 GB.

Then every loader runs in a fresh subprocess of its own (`--child KIND DIR`), so that each has its own peak:

- `jaxllm`: `jaxllm.interop.hf.load_pretrained(DIR, shardings, overrides)` onto the parameter shardings of
  a ZeRO-3 run with mesh fsdp=8 (`config_for` -> `config.validate` -> `mesh.make_mesh` -> `train.step.
  make_step_fns(...).state_shardings.params`) over 8 fake CPU devices (XLA_FLAGS=
  --xla_force_host_platform_device_count=8). The result is fp32. Timed: load_pretrained (reading config.json
  again, the index, every tensor) up to `block_until_ready`; not timed: importing JAX, the mesh, the step
  functions (shardings).
- `hf-bf16`, `hf-fp32`: transformers' `AutoModelForCausalLM.from_pretrained(DIR, dtype=...)` with bfloat16
  (the files' dtype, no conversion) and float32 (the same fp32 result jaxllm gives). Timed: the call; not
  timed: importing torch, transformers and its llama modeling code.

Memory: just before the timed call the child reads its resident set (VmRSS, the baseline) and resets the
kernel's high-water mark (`echo 5 > /proc/self/clear_refs`); after it, VmHWM is the peak resident set of
the load. Transient = peak - baseline - the result's bytes held in the process's own memory (jaxllm: the
sum of `nbytes` of every shard on every device; the fake CPU devices keep their buffers in host memory, so
they are part of the resident set; transformers: the model's parameters and buffers, tied ones once, less
those whose storage lies in a mapping of a file (/proc/self/maps): transformers' bf16 load leaves the
parameters as views of the mmap'd safetensors files, untouched pages of the page cache, not resident).
The resident set counts file pages too: both loaders read safetensors through mmap, and the mapped pages
a load touches count until unmapped, though they are the page cache's (shared, reclaimable). So the parent
also samples the child's /proc/PID/status every 4 ms and reports the peak of anonymous memory (RssAnon)
within the timed window: transient (anon) = peak RssAnon - baseline RssAnon - the result's held bytes, the
memory a load needs beyond its result that is not page cache. "Left over" is the same at the end of the
load (memory the load leaves allocated beyond its result), and again after a `gc.collect()` (which also
runs jaxlib's `collect_garbage`, releasing host arrays whose release jaxlib deferred). CPU time is the
child's user + system time (getrusage) over the load; minor faults, its first touches of memory pages.
The files are read into the page cache (a warm-up read) before the first measurement, so every loader
reads from memory, not disk.

Loaders take turns (`--repeats` rounds, each running them in a rotated order); medians are reported.
The last stdout line is a JSON object; a markdown table comes before it. After timing, the jaxllm child
compares a few imported values with the file's (`max_abs_diff_vs_file`, 0 when the import is right).
About 2 minutes on 2 CPU cores with --repeats 3 --profile, peak ~7.5 GiB per child.

`--profile` also runs jaxllm's import once more with the time inside `hf.Files.read` (the safetensors
slice read and the conversion to fp32), `hf.read_block` (pad, rearrange: views), `hf.read_leaf` (the
np.stack of the layers, which keeps each layer's transposed strides) and `jax.make_array_from_callback`
(placing each block on its device: XLA:CPU copies a numpy array that is not 64-byte aligned, and makes it
row-major on the way, the transpose from torch's [out, in]), each exclusive of the ones it calls, per leaf,
and `block_until_ready` after, to show where the import spends its time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("jaxllm", "hf-bf16", "hf-fp32")
FSDP = 8
# What the run sets besides the checkpoint's architecture: ZeRO-3 over fsdp=8, a sequence length.
OVERRIDES = {"mesh.fsdp": FSDP, "mesh.dp": 1, "train.zero_stage": 3, "model.seq_len": 2048}
# Llama-3.2-1B's config.json (architecture, RoPE, token ids), as transformers 5 keywords.
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, hidden_act="silu", rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# save_pretrained counts 1 GB = 1e9 bytes and closes a shard before the tensor that would pass the limit:
# the bf16 model is 2.47 GB (embeddings 525 MB, 121.6 MB per layer), so 1 GB gives 3 shards.
MAX_SHARD_SIZE = "1GB"
STD = 0.02
GiB = 2**30


# ---------------------------------------------------------------- the checkpoint


def make(path: str) -> None:
    """Write the random LLaMA-3.2-1B-shaped bf16 checkpoint to `path` (3 shards)."""
    import torch
    import transformers

    if os.path.exists(path) and os.listdir(path):
        sys.exit(f"error: {path} exists and is not empty; choose a new directory")
    t0 = time.perf_counter()
    config = transformers.LlamaConfig(**LLAMA_1B)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.to(torch.bfloat16)
    model.tie_weights()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights once
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, STD, generator=generator)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
    model.save_pretrained(path, max_shard_size=MAX_SHARD_SIZE)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    n = sum(p.numel() for p in model.parameters())
    print(f"{path}: {n:,} parameters, {len(files)} shards ({', '.join(files)}), {size / 1e9:.2f} GB, "
          f"made in {time.perf_counter() - t0:.1f} s")
    if len(files) != 3:
        sys.exit(f"error: expected 3 shards, save_pretrained wrote {len(files)}")


# ---------------------------------------------------------------- measuring one loader (in a child process)


def _status() -> dict[str, int]:
    """This process's /proc status memory lines, in bytes."""
    return _read_status("/proc/self/status")


def _read_status(file: str) -> dict[str, int]:
    out = {}
    with open(file) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _jaxllm_setup(path: str):
    """The fsdp=8 ZeRO-3 run's parameter shardings (not timed)."""
    import jax

    from jaxllm import config as config_lib
    from jaxllm import mesh as mesh_lib
    from jaxllm.interop import hf
    from jaxllm.trainer import step

    if jax.device_count() != FSDP:
        sys.exit(f"error: {jax.device_count()} devices; run with "
                 f"XLA_FLAGS=--xla_force_host_platform_device_count={FSDP}")
    cfg = hf.config_for(path, OVERRIDES)
    shape, _ = config_lib.validate(cfg, jax.device_count())
    mesh = mesh_lib.make_mesh(shape, cfg)
    return step.make_step_fns(cfg, mesh).state_shardings.params


def _jaxllm_load(path: str, shardings):
    import jax

    from jaxllm.interop import hf

    _, params = hf.load_pretrained(path, shardings, OVERRIDES)
    return jax.block_until_ready(params)


def _jaxllm_bytes(params) -> tuple[int, int]:
    """(bytes of every shard on every device, 0: none is mapped from a file)."""
    import jax

    return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards), 0


def _jaxllm_check(path: str, params) -> float:
    """Largest |difference| between a few imported values and the file's (a sanity check, not timed)."""
    import numpy as np
    from safetensors import safe_open

    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    worst = 0.0
    with safe_open(os.path.join(path, index["model.embed_tokens.weight"]), "pt") as f:
        emb = f.get_slice("model.embed_tokens.weight")[:4].float().numpy()
    worst = max(worst, float(np.abs(np.asarray(params["embed"]["tok"][:4]) - emb).max()))
    key = "model.layers.5.mlp.down_proj.weight"  # [e, f] in the file, ours [layers, f, e]
    with safe_open(os.path.join(path, index[key]), "pt") as f:
        down = f.get_slice(key)[:, :8].float().numpy()
    worst = max(worst, float(np.abs(np.asarray(params["blocks"][0]["mlp"]["w_down"][5, :8, :]) - down.T).max()))
    return worst


def _hf_load(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))


def _file_mappings() -> list[tuple[int, int]]:
    """This process's memory ranges that map a file (from /proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def _hf_bytes(model) -> tuple[int, int]:
    """(bytes of the model's parameters and buffers, tied ones once; those of them that are mapped from a file)."""
    seen, total, mapped, files = set(), 0, 0, _file_mappings()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
            if any(lo <= t.data_ptr() < hi for lo, hi in files):
                mapped += t.numel() * t.element_size()
    return total, mapped


def child(kind: str, path: str) -> None:
    """Load `path` once with loader `kind`; print one JSON line."""
    if kind == "jaxllm":
        import jax

        shardings = _jaxllm_setup(path)
        load, nbytes = (lambda: _jaxllm_load(path, shardings)), _jaxllm_bytes
        versions = {"jax": jax.__version__}
    else:
        import torch
        import transformers
        import transformers.models.llama.modeling_llama  # the model's code, imported before the baseline

        torch.set_num_threads(os.cpu_count() or 1)
        load, nbytes = (lambda: _hf_load(path, kind.removeprefix("hf-").replace("bf16", "bfloat16").replace(
            "fp32", "float32"))), _hf_bytes
        versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    before = _status()
    _reset_peak()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    start_wall, t0 = time.time(), time.perf_counter()
    result = load()
    seconds = time.perf_counter() - t0
    end_wall = time.time()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    after = _status()
    gc.collect()  # also runs jaxlib's collect_garbage (a gc callback): Python objects whose release it deferred
    collected = _status()
    total, mapped = nbytes(result)
    out = dict(kind=kind, seconds=seconds, cpu_seconds=(r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
               user_seconds=r1.ru_utime - r0.ru_utime, sys_seconds=r1.ru_stime - r0.ru_stime,
               minor_faults=r1.ru_minflt - r0.ru_minflt, baseline_rss=before["VmRSS"],
               baseline_anon=before["RssAnon"], peak_rss=after["VmHWM"], end_rss=after["VmRSS"],
               end_anon=after["RssAnon"], end_anon_after_gc=collected["RssAnon"], result_bytes=total,
               result_mapped_bytes=mapped, start=start_wall, end=end_wall, **versions)
    if kind == "jaxllm":
        out["max_abs_diff_vs_file"] = _jaxllm_check(path, result)
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------- profile (jaxllm, one run, per leaf kind)


def profile(path: str) -> None:
    """Where jaxllm's import spends its time: seconds inside hf's reading functions, per leaf, exclusive."""
    import jax

    from jaxllm.interop import hf

    shardings = _jaxllm_setup(path)
    inclusive: dict[tuple[str, str], float] = {}  # (leaf, function) -> seconds inside it, callees included
    reads: dict[str, int] = {}
    current = ["-"]

    def timed(label, fn, leaf_of=None):
        def wrapper(*args, **kwargs):
            if leaf_of is not None:
                current[0] = leaf_of(*args)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                k = (current[0], label)
                inclusive[k] = inclusive.get(k, 0.0) + time.perf_counter() - t0
                if label == "read":
                    reads[current[0]] = reads.get(current[0], 0) + 1
        return wrapper

    name = lambda path_: "/".join(str(p) for p in path_ if not isinstance(p, int))
    hf.Files.read = timed("read", hf.Files.read)
    hf.read_block = timed("block", hf.read_block)
    hf.read_leaf = timed("leaf", hf.read_leaf, lambda files, m, path_, *rest: name(path_))
    make_array = jax.make_array_from_callback
    jax.make_array_from_callback = timed("make", make_array)
    gc.collect()
    t0 = time.perf_counter()
    _, params = hf.load_pretrained(path, shardings, OVERRIDES)
    t1 = time.perf_counter()
    jax.block_until_ready(params)
    t2 = time.perf_counter()
    jax.make_array_from_callback = make_array
    before_gc = _status()["RssAnon"]
    gc.collect()
    after_gc = _status()["RssAnon"]
    cols = {"read": "Files.read: safetensors slice (flax) -> fp32 numpy",
            "block": "read_block: pad, rearrange (views)",
            "leaf": "read_leaf: np.stack of the layers (a copy that keeps each layer's strides)",
            "make": "make_array_from_callback: device_put of each block (a copy, made row-major)"}
    inner = {"read": None, "block": "read", "leaf": "block", "make": "leaf"}
    leaves = sorted({k[0] for k in inclusive if k[0] != "-"}, key=lambda l: -inclusive.get((l, "make"), 0.0))
    excl = {(l, c): inclusive.get((l, c), 0.0) - (inclusive.get((l, inner[c]), 0.0) if inner[c] else 0.0)
            for l in leaves for c in cols}
    # make_array_from_callback runs before read_leaf sets the leaf name: its time is under the previous leaf
    # or "-"; count it by leaf from the calls it made (inclusive make minus inclusive leaf is only right in sum)
    make_total = sum(v for k, v in inclusive.items() if k[1] == "make")
    leaf_total = sum(v for k, v in inclusive.items() if k[1] == "leaf")
    print(f"jaxllm import, profiled run: {t2 - t0:.1f} s: load_pretrained returned after {t1 - t0:.1f} s, "
          f"block_until_ready {t2 - t1:.1f} s more (device_put copies finishing); anon memory "
          f"{(before_gc - after_gc) / GiB:.2f} GiB freed by gc.collect() after the load")
    print("\n| leaf | reads | " + " | ".join(cols[c] for c in ("read", "block", "leaf")) + " |")
    print("|---|---:|" + "---:|" * 3)
    for l in leaves:
        print(f"| {l} | {reads.get(l, 0)} | " + " | ".join(f"{excl[l, c]:.2f} s" for c in ("read", "block", "leaf"))
              + " |")
    sums = {c: sum(excl[l, c] for l in leaves) for c in ("read", "block", "leaf")}
    print(f"| **all** | {sum(reads.values())} | " + " | ".join(f"**{v:.2f} s**" for v in sums.values()) + " |")
    print(f"\n{cols['make']}, beyond reading: {make_total - leaf_total:.2f} s; block_until_ready: {t2 - t1:.2f} s; "
          f"the rest of load_pretrained (config, index, tree): {t1 - t0 - make_total:.2f} s")
    print("PROFILE " + json.dumps({"seconds": t2 - t0, "load_pretrained": t1 - t0, "block_until_ready": t2 - t1,
                                   "device_put": make_total - leaf_total, "rest": t1 - t0 - make_total,
                                   "freed_by_gc": before_gc - after_gc,
                                   "by_leaf": {l: {c: excl[l, c] for c in ("read", "block", "leaf")}
                                               | {"reads": reads.get(l, 0)} for l in leaves}}))


# ---------------------------------------------------------------- the parent: runs, samples, reports


def _run_child(kind: str, path: str, timeout: float) -> dict:
    env = dict(os.environ)
    if kind == "jaxllm":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={FSDP}").strip()
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench.hf_import", "--child", kind, path], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, int, int]] = []  # (time, RssAnon, VmRSS)
    done = threading.Event()

    def sample():
        status = f"/proc/{proc.pid}/status"
        while not done.is_set():
            try:
                s = _read_status(status)
                samples.append((time.time(), s.get("RssAnon", 0), s.get("VmRSS", 0)))
            except (OSError, ValueError):
                pass
            time.sleep(0.004)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        sys.exit(f"error: {kind} took longer than {timeout:.0f} s\n{stderr[-3000:]}")
    finally:
        done.set()
        sampler.join()
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"error: {kind} failed (exit {proc.returncode})\n{stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    window = [s for s in samples if r["start"] <= s[0] <= r["end"]]
    r["peak_anon_sampled"] = max((s[1] for s in window), default=r["end_anon"])
    r["samples"] = len(window)
    held = r["result_bytes"] - r["result_mapped_bytes"]  # the result's bytes in the process's own memory
    r["transient"] = r["peak_rss"] - r["baseline_rss"] - held
    r["transient_anon"] = max(r["peak_anon_sampled"], r["end_anon"]) - r["baseline_anon"] - held
    r["retained_anon"] = r["end_anon"] - r["baseline_anon"] - held
    r["retained_anon_after_gc"] = r["end_anon_after_gc"] - r["baseline_anon"] - held
    return r


def _warm_page_cache(path: str) -> float:
    t0, n = time.perf_counter(), 0
    for f in sorted(os.listdir(path)):
        with open(os.path.join(path, f), "rb") as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return n / (time.perf_counter() - t0) / 1e9


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(path: str, runs: list[dict]) -> dict:
    by = {k: [r for r in runs if r["kind"] == k] for k in KINDS}
    keys = ("seconds", "cpu_seconds", "user_seconds", "sys_seconds", "minor_faults", "peak_rss", "baseline_rss",
            "result_bytes", "result_mapped_bytes", "transient", "transient_anon", "retained_anon",
            "retained_anon_after_gc", "peak_anon_sampled", "baseline_anon")
    med = {k: {key: _median(rs, key) for key in keys} for k, rs in by.items() if rs}
    names = {"jaxllm": "jaxllm `load_pretrained`, fsdp=8 (fp32)", "hf-bf16": "transformers `from_pretrained`, bf16",
             "hf-fp32": "transformers `from_pretrained`, fp32"}
    g = lambda x: f"{x / GiB:.2f} GiB"
    print(f"\n{path}: {len(runs)} loads; medians of {', '.join(f'{len(v)} {k}' for k, v in by.items())}\n")
    print("| loader | time | CPU time (user + sys) | minor faults | baseline RSS | peak RSS | result (of it mapped "
          "from the files) | transient (RSS) | transient (anon) | left over at the end (anon), after gc |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, m in med.items():
        print(f"| {names[k]} | {m['seconds']:.1f} s | {m['cpu_seconds']:.1f} s ({m['user_seconds']:.1f} + "
              f"{m['sys_seconds']:.1f}) | {m['minor_faults'] / 1e6:.2f} M | {g(m['baseline_rss'])} | "
              f"{g(m['peak_rss'])} | "
              f"{g(m['result_bytes'])} ({g(m['result_mapped_bytes'])}) | {g(m['transient'])} | "
              f"{g(m['transient_anon'])} | {g(m['retained_anon'])}, {g(m['retained_anon_after_gc'])} |")
    ratios = {}
    if "jaxllm" in med:
        print()
        for peer in ("hf-bf16", "hf-fp32"):
            if peer in med:
                j, p = med["jaxllm"], med[peer]
                # a ratio against a peer that needs (almost) nothing says nothing: n/a below 64 MiB
                ratio = lambda a, b: a / b if b > 64 * 2**20 else None
                ratios[peer] = {"time": j["seconds"] / p["seconds"], "cpu": j["cpu_seconds"] / p["cpu_seconds"],
                                "transient": ratio(j["transient"], p["transient"]),
                                "transient_anon": ratio(j["transient_anon"], p["transient_anon"]),
                                "transient_minus_peer": j["transient"] - p["transient"],
                                "transient_anon_minus_peer": j["transient_anon"] - p["transient_anon"]}
                fmt = lambda x: "n/a (peer < 64 MiB)" if x is None else f"{x:.2f}x"
                q = ratios[peer]
                print(f"jaxllm / {peer}: time {fmt(q['time'])}, CPU time {fmt(q['cpu'])}, transient (RSS) "
                      f"{fmt(q['transient'])} ({q['transient_minus_peer'] / GiB:+.2f} GiB), transient (anon) "
                      f"{fmt(q['transient_anon'])} ({q['transient_anon_minus_peer'] / GiB:+.2f} GiB)")
    print("\nper run (in order): " + ", ".join(
        f"{r['kind']} {r['seconds']:.1f} s / {r['transient'] / GiB:.2f} GiB" for r in runs))
    return {"path": path, "median": med, "ratios_jaxllm_over": ratios, "runs": runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.hf_import", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("path", help="the checkpoint directory (made with --make)")
    p.add_argument("--make", action="store_true", help="write the random LLaMA-3.2-1B-shaped bf16 checkpoint to PATH")
    p.add_argument("--repeats", type=int, default=3, help="rounds; every loader runs once a round (default 3)")
    p.add_argument("--only", default=",".join(KINDS), help=f"comma-separated loaders (default {','.join(KINDS)})")
    p.add_argument("--profile", action="store_true", help="also one profiled jaxllm import (where its time goes)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one load may take (default 900)")
    p.add_argument("--child", choices=KINDS + ("profile",), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child == "profile":
        return profile(a.path)
    if a.child:
        return child(a.child, a.path)
    if a.make:
        return make(a.path)
    kinds = [k for k in a.only.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        sys.exit(f"error: --only {a.only!r}: choose from {', '.join(KINDS)}")
    if not os.path.isfile(os.path.join(a.path, "config.json")):
        sys.exit(f"error: {a.path}: no config.json; make the checkpoint first with --make {a.path}")
    print(f"page cache warmed ({_warm_page_cache(a.path):.1f} GB/s read)", flush=True)
    runs = []
    for r in range(a.repeats):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]  # rotated, so no loader always runs first
        for kind in order:
            runs.append(_run_child(kind, a.path, a.timeout))
            x = runs[-1]
            print(f"round {r + 1} {kind}: {x['seconds']:.1f} s, peak RSS {x['peak_rss'] / GiB:.2f} GiB, "
                  f"result {x['result_bytes'] / GiB:.2f} GiB, transient {x['transient'] / GiB:.2f} GiB "
                  f"(anon {x['transient_anon'] / GiB:.2f} GiB, {x['samples']} samples)", flush=True)
    out = report(a.path, runs)
    if a.profile:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={FSDP}",
                   PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
        proc = subprocess.run([sys.executable, "-m", "tools.bench.hf_import", "--child", "profile", a.path],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
        lines = proc.stdout.splitlines()
        print("\n" + "\n".join(l for l in lines if not l.startswith("PROFILE ")))
        prof = [l for l in lines if l.startswith("PROFILE ")]
        if proc.returncode or not prof:
            sys.exit(f"error: profile failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
        out["profile"] = json.loads(prof[-1][len("PROFILE "):])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
