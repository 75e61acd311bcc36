"""What the test files share: one registry of compiled programs, the batches a step gets, the
independent references, the equivalence tolerances and subprocess environments.

- `step_fns(cfg, devices)` is the one registry of step programs: a config (resolved to TOML)
  on n devices is built once, so every test asking for the same program gets the same jitted
  functions, already compiled. Below it, `compile_each_program_once` hands any jitted function
  that lowers to a program compiled before the executable compiled then. Both live as long as the
  test process, until it holds half the memory mappings Linux allows
  (`free_programs_near_the_map_limit`, after each test file). The one-device command lines tests
  start share JAX's persistent compilation cache instead (`subprocess_env`; see conftest.py).
- `loss_and_grads`, `loss_metrics_and_grads`, `train_step`, `eval_loss` and `lower_loss_and_grads`
  are the only places a test hands a batch to a step: they turn token windows into the batch
  contract's fields (`jaxllm/batch.py`, plus any the step's objective needs) and lay the
  parameters and the batch out as the step wants them.
- `reference(model_cfg)` is the loss and gradients of the model written independently of
  `jaxllm/models/` (`tools/reference/plain_gpt.py`, `tools/reference/plain_llama.py`) on `tokens()`, from
  jaxllm's own initial parameters.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tools/ is importable from the tests
    sys.path.insert(0, str(REPO))

# LLVM at -O0 and XLA:CPU's older loop emitters: each about halves the compile time of a step. One LLVM
# module per program instead of XLA's split for parallel codegen: a fifth less compile CPU on two cores,
# and about half the memory mappings per executable (see `free_programs_near_the_map_limit`).
# The loop emitters' switch is gone from jaxlib 0.11's XLA, which aborts on a flag it does not know.
COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1")

BATCH, SEQ = 16, 32  # the equivalence batch: 16 windows of 33 tokens
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-8

# A small real text for runs where the corpus does not matter: the `os` module's source (~40 KB),
# on every machine with Python, loaded in milliseconds (the default corpus, the whole standard
# library, takes seconds to read and tokenise).
CORPUS = os.__file__


def measured(key: str) -> bool:
    """Whether a metrics.jsonl column is a measurement, which differs between any two runs (timings, memory)."""
    return key in ("tokens_per_s", "step_time_s", "mfu") or key.startswith(("time/", "memory/"))


def unmeasured(row: dict) -> dict:
    """A metrics row without its measurements: what two runs of the same steps must agree on."""
    return {k: v for k, v in row.items() if not measured(k)}


def _jaxlib_before(major: int, minor: int) -> bool:
    from importlib.metadata import version  # not `import jaxlib`: the flags are set before it loads

    return tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (major, minor)


def compile_flags(n_devices: int) -> str:
    """The tests' XLA flags for n fake CPU devices, plus any other flag the caller's XLA_FLAGS sets: so
    `XLA_FLAGS=--xla_cpu_max_isa=AVX2 pytest` runs every test, command lines included, as on a CPU without
    AVX-512 (XLA:CPU's code, so its rounding, differs by instruction set: that is how a machine of the other
    vendor can be tried here)."""
    emitters = ("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_before(0, 11) else ()
    ours = (f"--xla_force_host_platform_device_count={n_devices}",) + COMPILE_FLAGS + emitters
    names = {f.split("=")[0] for f in ours}
    theirs = tuple(f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in names)
    return " ".join(ours + theirs)


def subprocess_env(n_devices: int = 8) -> dict:
    """The environment for a CLI the tests start: this checkout importable, n fake CPU devices, the
    cheap-compile flags, and the session's persistent compilation cache (every program that took
    a noticeable time to compile; JAX's default threshold is 1 s)."""
    # Multi-device programs are compiled afresh: XLA:CPU reads a program back from the persistent cache
    # without the order between the collectives inside its loops and those outside, and it can hang
    # (tools/dev/xla_cpu_cache_hang.py, docs/design-notes.md), so only one-device programs come from the cache.
    cache = os.environ.get("JAXLLM_TEST_CACHE_DIR", "") if n_devices == 1 else ""
    path = str(REPO)
    if os.environ.get("JAXLLM_COMPILE_LEDGER"):  # the command line records its compiles too
        from tools.dev.compile_ledger import SITE

        path = f"{SITE}{os.pathsep}{path}"
    return dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", XLA_FLAGS=compile_flags(n_devices),
                JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")


# ---------------------------------------------------------------- configs and the program registry


def equivalence_config(preset: str, **over):
    """The equivalence tests' config: `preset` at seq 32, batch 16, byte vocabulary, fp32, one device
    unless the overrides name mesh axes."""
    base = {"model.preset": preset, "model.vocab_size": 257, "model.seq_len": SEQ, "precision.compute": "float32",
            "train.global_batch": BATCH, "train.lr": 1e-3, "train.warmup_steps": 0, "train.steps": 20,
            "mesh.dp": 1}
    from jaxllm.config import build_config

    return build_config(None, {**base, **over})


_programs: dict = {}


def step_fns(cfg, devices: int | None = None, objective=None):
    """The compiled step functions of `cfg` on the first `devices` devices (default: as many as the
    mesh uses; an axis at -1 counts as 1) for `objective` (default: the config's, `step.objective_of`), built
    once per test file."""
    import jax

    from jaxllm.config import to_toml, validate
    from jaxllm.mesh import make_mesh
    from jaxllm.trainer.step import make_step_fns, objective_of

    objective = objective or objective_of(cfg)
    if devices is None:
        devices = math.prod(v for k, v in vars(cfg.mesh).items() if isinstance(v, int) and v > 0)
    key = (to_toml(cfg), devices, objective.name)
    if key not in _programs:
        shape, notes = validate(cfg, devices)
        fns = make_step_fns(cfg, make_mesh(shape, cfg, devices=jax.devices()[:devices]), objective)
        fns.notes = notes
        _programs[key] = fns
    return _programs[key]


def forget_programs() -> None:
    """Drop the registry, the shared executables and JAX's caches, so their executables (and the code XLA
    mapped for them) are freed."""
    import jax

    _programs.clear()
    _executables.clear()
    jax.clear_caches()


# ---------------------------------------------------------------- one compile per program and process

_executables: dict = {}  # JAX's persistent-cache key -> the executable XLA compiled for it
REUSED = "/jaxllm/tests/executable_reused"  # a jax.monitoring event, one per compile saved


def compile_each_program_once() -> None:
    """Hand every later request for an XLA program this process has compiled the executable compiled the
    first time: two jitted functions (two step registries, two in-process training runs, two test files)
    that lower to one program compile once. The key is the one JAX's persistent cache files the program
    under (canonical StableHLO, compile options with the device assignment, XLA flags, jaxlib). JAX's
    persistent cache itself serves only one-device programs (`subprocess_env`): XLA:CPU loses the order of
    a multi-device program's collectives when it reads one back (docs/design-notes.md). Programs with
    host callbacks are left alone (their pointers are in the program, as JAX's own cache does)."""
    import inspect

    from jax import monitoring

    try:
        from jax._src import cache_key, compiler

        compile_or_get_cached = compiler.compile_or_get_cached
    except (ImportError, AttributeError):  # a JAX without these private names: compile as JAX does
        return
    if getattr(compile_or_get_cached, "_once", False):
        return
    signature = inspect.signature(compile_or_get_cached)  # arguments by name: JAX versions add parameters

    @functools.wraps(compile_or_get_cached)  # its signature, for whoever wraps it next (the compile ledger)
    def once(*args, **kwargs):
        a = signature.bind(*args, **kwargs).arguments
        if a["host_callbacks"]:
            return compile_or_get_cached(*args, **kwargs)
        key = cache_key.get(a["computation"], a["devices"], a["compile_options"], a["backend"])
        if key in _executables:
            monitoring.record_event(REUSED)
        else:
            _executables[key] = compile_or_get_cached(*args, **kwargs)
        return _executables[key]

    once._once = True
    compiler.compile_or_get_cached = once


def memory_maps() -> tuple[int, int]:
    """(memory mappings this process holds, the most Linux allows it: vm.max_map_count)."""
    with open("/proc/self/maps") as f:
        held = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
        return held, int(f.read())


# Measured by `python -m tools.dev.compile_ledger`: one test file adds at most about 16,500 mappings
# (test_context_parallel.py), so freeing at the first file end past half of Linux's 65,530 leaves the
# largest file room to spare (docs/design-notes.md).
MAP_SHARE = 0.5


def free_programs_near_the_map_limit() -> bool:
    """Forget the compiled programs if this process holds more than MAP_SHARE of the mappings Linux allows
    (XLA:CPU maps each executable's code in about a hundred regions; past the limit, a compile crashes).
    Returns whether they were freed."""
    held, limit = memory_maps()
    if held <= MAP_SHARE * limit:
        return False
    forget_programs()
    return True


def freeze_what_lives(thaw: bool = False) -> None:
    """Collect the garbage made since the last call (everything, after a thaw: `thaw` when what was frozen may
    have died, as the programs `forget_programs` dropped), then move every object still alive into the cyclic
    collector's permanent generation (`gc.freeze`). What outlives a test file (modules, the program registry,
    JAX's caches) is then not walked again at every full collection: late in a session those walks were a
    quarter of a worker's CPU (perf, docs/design-notes.md)."""
    import gc

    if thaw:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


# ---------------------------------------------------------------- batches and steps


@functools.lru_cache(maxsize=None)
def _text():
    import numpy as np

    return np.frombuffer(open(CORPUS, "rb").read(), np.uint8).astype(np.uint16)


def tokens(step: int = 0, batch: int = BATCH, seq: int = SEQ):
    """[batch, seq + 1] windows of real text (bytes of the `os` module), different for each step."""
    from jaxllm.data import batch_rows, window_starts

    stream = _text()
    return batch_rows(stream, window_starts(len(stream), 0, step, batch, seq), slice(None), seq)


def as_batch(toks, **fields) -> dict:
    """The batch contract's fields from [batch, seq + 1] token windows, plus `fields` (an objective's own)."""
    from jaxllm.batch import from_windows

    return {**from_windows(toks), **fields}


def _put(fns, params, toks, fields):
    import jax

    batch = as_batch(tokens() if toks is None else toks, **(fields or {}))
    return jax.device_put(params, fns.state_shardings.params), jax.device_put(batch, fns.batch_sharding)


def loss_and_grads(fns, params, toks=None, fields=None):
    """One step's (loss, gradients) for `params` on a token batch (default `tokens()`)."""
    loss, _, grads = fns.loss_and_grads(*_put(fns, params, toks, fields))
    return loss, grads


def loss_metrics_and_grads(fns, params, toks=None, fields=None):
    """One step's (loss, metrics, gradients); `fields` holds the objective's own batch fields."""
    return fns.loss_and_grads(*_put(fns, params, toks, fields))


def eval_loss(fns, params, toks=None):
    """(summed token loss, token count, metric sums) of the evaluation program."""
    return fns.eval_loss(*_put(fns, params, toks, None))


def train_step(fns, state, toks=None, fields=None):
    """One optimizer step from `state` (laid out as the step wants it): (new state, metrics)."""
    import jax

    state = jax.device_put(state, fns.state_shardings)
    return fns.train_step(state, _put(fns, state.params, toks, fields)[1])


def lower_loss_and_grads(fns, batch: int = BATCH, seq: int = SEQ, params=None, toks=None):
    """The loss-and-gradients program lowered for a [batch, seq] batch (or for `params` and
    `toks` as given), for reading its program and, compiled, its memory without running it."""
    if toks is None:
        params = fns.abstract_state.params if params is None else params
        return fns.loss_and_grads.lower(params, fns.abstract_batch(batch, seq))
    return fns.loss_and_grads.lower(*_put(fns, params, toks, None))


# ---------------------------------------------------------------- the independent references


_references: dict = {}


def reference(m):
    """(jaxllm's initial parameters (seed 0), loss, gradients) of model config `m` on `tokens()`, computed
    by the plain reference in fp32: the language-model loss, and the gradients of the whole objective
    (MoE: with the auxiliary losses), in jaxllm's tree."""
    import jax
    import jax.numpy as jnp

    from jaxllm.models import transformer

    from tools.reference import plain_model

    key = repr(m)
    if key not in _references:
        module, c = plain_model(m)

        def objective(p, t):  # (LM loss + auxiliary losses, LM loss)
            lm, aux = module.losses(module.from_jaxllm(p), t, c)
            return lm + aux, lm

        params = jax.jit(lambda k: transformer.init_params(m, k))(jax.random.key(0))
        (_, loss), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params, jnp.asarray(tokens()))
        _references[key] = (jax.device_get(params), float(loss), jax.device_get(grads))
    return _references[key]


# ---------------------------------------------------------------- comparing


# Not chex.assert_trees_all_close (elementwise): the contract is per leaf in norms, and a failure prints them.
def with_random_b(params, seed: int = 1):
    """The parameters with every LoRA adapter's B drawn (a fresh B is zero, so A's gradient would be too)."""
    import jax

    from jaxllm.models import lora

    nodes = [x for x in jax.tree.leaves(params, is_leaf=lora.is_node) if lora.is_node(x)]
    keys = iter(jax.random.split(jax.random.key(seed), len(nodes)))
    return jax.tree.map(lambda x: x.replace(b=0.05 * jax.random.normal(next(keys), x.b.shape)) if lora.is_node(x)
                        else x, params, is_leaf=lora.is_node)


def leaf_errors(a, b) -> dict:
    """Per gradient leaf (by tree path): ||a - b|| and ||b||, in float64."""
    import jax
    import numpy as np

    out = {}
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out[jax.tree_util.keystr(path)] = (float(np.linalg.norm(x - y)), float(np.linalg.norm(y)))
    return out


def assert_matches(loss, grads, ref, loss_rtol: float = LOSS_RTOL, grad_rtol: float = GRAD_RTOL) -> None:
    """The equivalence contract: |loss - ref| <= 1e-5 |ref| and, per gradient leaf,
    ||g - ref|| <= 1e-4 ||ref|| + 1e-8. `ref` is (params, loss, grads) as `reference` returns it."""
    import chex

    _, ref_loss, ref_grads = ref
    chex.assert_trees_all_equal_structs(grads, ref_grads)
    assert abs(float(loss) - ref_loss) <= loss_rtol * abs(ref_loss), (float(loss), ref_loss)  # False for a NaN
    bad = {k: (d, n) for k, (d, n) in leaf_errors(grads, ref_grads).items()
           if not d <= grad_rtol * n + GRAD_ATOL}  # `not <=`: a NaN is off too
    assert not bad, f"gradient leaves off the reference (||a-b||, ||b||): {bad}"


def max_rel_err(a, b) -> float:
    """Largest per-leaf ||a - b|| / ||b|| between two runs of jaxllm (mesh against one device).

    A leaf whose exact gradient is zero holds only rounding noise (GPT-2's key bias: adding a
    constant to every key shifts all scores of a query equally, which softmax ignores), so its
    norm is floored at 1e-6 of the whole tree's norm."""
    import numpy as np

    errs = leaf_errors(a, b)
    total = float(np.sqrt(sum(n * n for _, n in errs.values())))
    return max(d / max(n, 1e-6 * total) if np.isfinite(d) else np.inf for d, n in errs.values())


def warm(state):
    """Adam's state as after some training: a positive second moment, so that one update is a smooth
    function of the gradient. (At step 1 the update is g / (|g| + eps), which turns the rounding
    noise of entries with |g| ~ eps into O(1) differences.) Shardings are kept."""
    return state.replace(opt_state=warm_optimizer_state(state.opt_state))


def warm_optimizer_state(opt_state):
    """`warm` for an optimizer state alone (clipping, then AdamW)."""
    import jax

    clip, (adam, *rest) = opt_state
    adam = adam._replace(count=adam.count * 0 + 10, nu=jax.tree.map(lambda v: v * 0 + 1e-4, adam.nu))
    return clip, (adam, *rest)


def tiers(cases, fast) -> list:
    """pytest parameters for `cases` (tuples, or single values): those in `fast` run in the fast tier,
    the rest are marked slow."""
    import pytest

    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=() if c in fast else pytest.mark.slow)
            for c in cases]
