"""The Python API: `load` a trained model and use it, `train` a config. The `jaxllm` command parses its
arguments and calls these.

    import jaxllm

    model = jaxllm.load("runs/mine")                 # the newest checkpoint; step=N for another, "hf:DIR"
    model.generate(["def fib(n):"], max_new_tokens=32, temperature=0)
    model.score([("2 + 2 =", " 4")])                 # log-probabilities of continuations
    model.evaluate(["tasks/arc.yaml"])               # lm-evaluation-harness's task files
    model.export("out/hf")                           # a directory transformers' from_pretrained loads
    result = jaxllm.train({"train.steps": 100})      # a Config, a dict of keys or a TOML file

Keys are the config's dotted names (`mesh.tp`, `precision.compute`), given as a dict or as `key=value` strings.
Every problem is a `jaxllm.errors.UserError` with one line naming it and the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import Config, build_config, config_path, parse_overrides, to_dict, to_toml, validate
from jaxllm.data import chat as chat_lib
from jaxllm.errors import ConfigError
from jaxllm.eval import exact_match, requests, run, score, tasks as tasks_lib
from jaxllm.generate import generate as generate_tokens
from jaxllm.generate.engine import Engine
from jaxllm.interop import export, gguf_io, hf
from jaxllm.mesh import initialize_distributed, make_mesh
from jaxllm.trainer import checkpoint as ckpt, goodput, metrics
from jaxllm.trainer.loop import (checkpoint_params, completion_text, initial_state, resolve, train as run_training,
                                 with_stored_base)
from jaxllm.trainer.state import PARAMS_ONLY
from jaxllm.trainer.step import make_step_fns

log = logging.getLogger("jaxllm")

# The distributed keys of a model read from a training run: this process's own (from the overrides), not the
# ones the run trained on.
OWN_PROCESSES = {"distributed.coordinator_address": "", "distributed.num_processes": 0,
                 "distributed.process_id": -1, "distributed.auto": False}


def _keys(overrides) -> dict:
    """`overrides` as a dict of dotted keys: a dict as given, `key=value` strings parsed as on the command line."""
    return dict(overrides) if isinstance(overrides, dict) else parse_overrides(list(overrides))


def config_of(config):
    """A Config from a Config, a dict of dotted keys (over the shipped default) or a TOML file's path (or a shipped
    config's name)."""
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return build_config(config_path(None), config)
    return build_config(config_path(os.fspath(config)))


def step_fns_for(cfg):
    """The step's programs for `cfg` on this process's devices, as the config lays them out (its data unread)."""
    shape, _ = validate(cfg, jax.device_count(), data=False)
    return make_step_fns(cfg, make_mesh(shape, cfg))


# ---------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a training run left: its directory, the step it ended at, its last training row of metrics.jsonl."""
    run_dir: str
    final_step: int
    last_row: dict


def train(config) -> RunResult:
    """Train as `config` says (a Config, a dict of dotted keys over the shipped default, or a TOML file)."""
    cfg = config_of(config)
    summary = run_training(cfg)
    written = os.path.isfile(os.path.join(cfg.run.dir, metrics.METRICS_FILE))  # by process 0 only
    rows = [r for r in metrics.read_metrics(cfg.run.dir) if "loss" in r] if written else []
    last = rows[-1] if rows else {}
    return RunResult(summary["run_dir"], last.get("step", summary["steps"]), last)


def import_hf(hf_dir: str, run_dir: str, overrides=()) -> str:
    """Write a Hugging Face model directory as a jaxllm run directory at step 0 (its config.toml and a checkpoint
    of the parameters only, `init.from = "hf:HF_DIR"`, its tokenizer where it has one); the run's config file."""
    given = {"run.dir": run_dir, **_keys(overrides)}
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        given.setdefault("data.tokenizer", f"hf:{hf_dir}")
    cfg = hf.config_for(hf_dir, given)
    if cfg.model.lora.rank:  # a LoRA run's checkpoints hold adapters, its base is read from init.from each time
        raise ConfigError("model.lora: adapters need no import; train with init.from=hf:DIR and the model.lora keys")
    if os.path.exists(run_dir) and os.listdir(run_dir):
        raise ConfigError(f"{run_dir}: exists and is not empty; choose a new run directory")
    params = hf.load_params(hf_dir, cfg.model, step_fns_for(cfg).state_shardings.params)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.toml")
    with open(path, "w") as f:
        f.write(to_toml(cfg))
    mngr = ckpt.open_manager(run_dir, keep=1)
    meta = {"config": to_dict(cfg), "step": 0, "state_fields": list(PARAMS_ONLY)}
    ckpt.save(mngr, 0, {"step": jnp.int32(0), "params": params}, meta, checked=cfg.train.checkpoint_checksums)
    mngr.wait_until_finished()
    mngr.close()
    return path


# ---------------------------------------------------------------- a trained model


class Generation(NamedTuple):
    """One prompt's generation: `text`, the prompt and its completion (as transformers' text-generation pipeline
    gives it); the new token ids (through the first stop id, kept), their log-probabilities, and whether it ended
    at a stop id."""
    text: str
    tokens: np.ndarray
    logprobs: np.ndarray
    stopped: bool


class Evaluation(NamedTuple):
    """`Model.evaluate`'s results (task -> metric -> value) and samples (task -> each request's record)."""
    results: dict
    samples: dict


def load(source: str, step: int | None = None, overrides=()) -> "Model":
    """The model of a run directory (its config, tokenizer and newest checkpoint, or checkpoint `step`; 0: the
    parameters it started from), of `hf:DIR` (a Hugging Face model directory) or of `gguf:FILE` (a GGUF file, its
    tokenizer and chat template from its metadata), on the mesh the overrides give
    (`{"mesh.tp": 2}` or `["mesh.tp=2"]`), in the run's `precision.compute` unless they say otherwise."""
    source = os.fspath(source)
    # the parameters stay on the device, wherever the run stored them between steps
    given = {**OWN_PROCESSES, "memory.offload_params": False, "memory.offload_optimizer": False, **_keys(overrides)}
    if source.startswith("hf:"):
        cfg = hf.config_for(source[3:], {"data.tokenizer": source, **given})
    elif source.startswith("gguf:"):
        cfg = build_config(None, {"init.from": source, "data.tokenizer": source, **given})
    elif os.path.isfile(os.path.join(source, "config.toml")):
        cfg = build_config(os.path.join(source, "config.toml"), {"run.dir": source, **given})
    else:
        raise ConfigError(f"{source}: not a run directory (no config.toml), hf:DIR nor gguf:FILE")
    initialize_distributed(cfg.distributed)
    tokenizer, _, _ = resolve(cfg, data=False)  # the run's training data need not be here
    fns = step_fns_for(cfg)
    if source.startswith("hf:"):
        params = hf.load_params(source[3:], cfg.model, fns.state_shardings.params)
    elif source.startswith("gguf:"):
        params = hf.load_from(gguf_io.GgufFiles(source[5:]), cfg.model, fns.state_shardings.params)
    elif step == 0:  # the run's starting parameters: its init.from, or its seed's random ones
        params = initial_state(cfg, fns).params
    else:  # a LoRA run's: its adapters on its base
        params = checkpoint_params(cfg, fns, source, step)
    log.info("model from %s on %d %s device(s), compute %s", source, jax.device_count(), jax.devices()[0].platform,
             cfg.precision.compute)
    return Model(cfg, tokenizer, fns, params, source)


@dataclasses.dataclass
class Model:
    """A model with its parameters on a mesh: `cfg` (the resolved Config), `tokenizer`, `fns` (its step's programs
    on the mesh), `params` (laid out as the run stores them), `source` (where it came from)."""
    cfg: object
    tokenizer: object
    fns: object
    params: object
    source: str

    def _ids(self, text) -> list[int]:
        """A prompt's token ids: text encoded, or ids as given; an empty prompt is the end-of-text token."""
        ids = list(self.tokenizer.encode(text)) if isinstance(text, str) else [int(i) for i in text]
        return ids or [self.tokenizer.eot]

    def generate(self, prompts, max_new_tokens: int | Sequence[int] = 64, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, timings: dict | None = None,
                 slots: int = 0, pages: int = 0) -> list[Generation]:
        """A completion of each prompt (a string, or token ids; one prompt or a list of them, generated as one
        batch) with the KV cache, until a stop id of the tokenizer or `max_new_tokens` (one for all, or one per
        prompt). temperature 0 is greedy;
        a row's draws depend on `seed` and its place in the list, not on the mesh. `timings` gets `compile_s` and
        `run_s`. `slots` > 0: on the rollout engine (`generate/engine.py`: paged, continuously batched, on the
        model's mesh) with that many slots, for many prompts of different lengths: the same tokens; `pages` its
        pools' pages (0: what the slots need; fewer and requests wait for pages)."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        ids = [self._ids(p) for p in ([prompts] if single else prompts)]
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "stop_ids": self.tokenizer.stop_ids,
                    "seed": seed}
        if slots:
            done = self._engine(ids, max_new_tokens, {"slots": slots, "pages": pages}, sampling, timings)
        else:
            done = generate_tokens(self.params, self.cfg, ids, max_new_tokens, on=self.fns, timings=timings,
                                   **sampling)
        return [Generation(completion_text(self.tokenizer, p, c.tokens), c.tokens, c.logprobs, c.stopped)
                for p, c in zip(ids, done)]

    def chat(self, questions: Sequence[str], max_new_tokens: int | Sequence[int] = 64, **sampling) -> list[str]:
        """Each question asked as a user turn through the model's chat template (`data.chat_template`: the
        tokenizer's own by default), its generation prompt opening the assistant's turn; the answers, up to the
        tokenizer's stop ids (the template's end of turn where it is one) or `max_new_tokens`. `max_new_tokens`
        and `sampling` as `generate`'s."""
        d = self.cfg.data
        template = chat_lib.load_template(d.chat_template, self.tokenizer, d.chat_template_kwargs)
        prompts = [[int(i) for i in self.tokenizer.encode_chat(chat_lib.render(
            template, [{"role": "user", "content": q}], add_generation_prompt=True)[0])[0]] for q in questions]
        done = self.generate(prompts, max_new_tokens, **sampling)
        return [requests.decode_new(self.tokenizer, g.tokens[:len(g.tokens) - g.stopped]) for g in done]

    def _engine(self, ids, max_new_tokens, sizes: dict, sampling: dict, timings: dict | None):
        """The rollout engine's completions, on the model's mesh (its weights resharded into the rollout layout),
        its `sizes` (slots, pages) as given."""
        start, compiled = time.perf_counter(), goodput.compiling_seconds()
        done = Engine(self.params, self.cfg, on=self.fns, **sizes).generate(ids, max_new_tokens, **sampling)
        if timings is not None:  # the engine compiles as it runs: JAX reports each compile's seconds
            compile_s = goodput.compiling_seconds() - compiled
            timings.update(compile_s=compile_s, run_s=time.perf_counter() - start - compile_s)
        return done

    def logits(self, texts) -> list[np.ndarray]:
        """fp32 logits [tokens, vocabulary] of each text (a string or token ids): the trainer's forward pass, on
        the model's mesh, `train.global_batch` texts at a time."""
        return score.logits(self.fns, self.params, [self._ids(t) for t in texts], self.cfg.model.seq_len,
                            self.cfg.train.global_batch)

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """The log-probability of each (context, continuation)'s continuation given its context, tokenized as
        lm-evaluation-harness does (the pair encoded whole, the context's tokens split off)."""
        encoded = [requests.encode_pair(self.tokenizer, context, continuation) for context, continuation in pairs]
        return score.loglikelihoods(self.fns, self.params, encoded, self.cfg.model.seq_len,
                                    self.cfg.train.global_batch)

    def evaluate(self, tasks, *, chat_template: bool = False, fewshot_as_multiturn: bool = True,
                 limit: float | None = None) -> Evaluation:
        """Benchmark tasks (files in lm-evaluation-harness's task format, or loaded `eval.tasks.Task`s) as
        lm-evaluation-harness 0.4 runs them; `chat_template`: the requests through the tokenizer's chat template,
        each few-shot example its own turns unless `fewshot_as_multiturn` is False; `limit`: each task's first
        documents only, as its `limit` (a number of them, or below 1 a share)."""
        loaded = [tasks_lib.first_docs(tasks_lib.load_task(os.fspath(t)) if isinstance(t, (str, os.PathLike)) else t,
                                       limit) for t in tasks]
        chat = None
        if chat_template:
            d = self.cfg.data
            template = chat_lib.load_template(d.chat_template, self.tokenizer, d.chat_template_kwargs)
            chat = requests.Chat(template, fewshot_as_multiturn)
        return Evaluation(*run.evaluate_all(loaded, self.tokenizer, self.fns, self.params, self.cfg, chat))

    def exact_match(self, path: str, *, limit: int = 0, max_new_tokens: int = 32, batch: int = 64):
        """Greedy exact-match on held-out examples (a JSONL file in the run's `data.format`): `eval.exact_match`'s
        Result (matches, requests, generated texts, references)."""
        return exact_match.run(self.cfg, self.tokenizer, self.fns, self.params, path, limit, max_new_tokens, batch)

    def export(self, path: str, format: str = "hf", *, dtype: str | None = None, max_shard_size: str = "5GB",
               adapter: bool = False) -> None:
        """Write the model where another tool reads it. `format="hf"`: a directory transformers' `from_pretrained`
        loads, in `dtype` (default: that of the checkpoint the run started from; float32 for random weights), with
        its source's generation config and the run's Hugging Face tokenizer files; a LoRA run's adapters merged
        in, or with `adapter=True` alone, as a PEFT adapter directory for its base. `format="gguf"`: a GGUF file
        llama.cpp reads (`dtype` f32, f16, bf16 or q8_0; default f32), a LoRA run's adapters merged in, with the
        tokenizer and chat template of a GGUF tokenizer."""
        if format not in ("hf", "gguf"):
            raise ConfigError(f"export format {format!r}: one of hf, gguf")
        if format == "gguf" and adapter:
            raise ConfigError("a GGUF export writes the model with its adapters merged in; export --adapter as hf")
        params = self.params if adapter else with_stored_base(self.cfg, self.fns, self.params)
        if format == "gguf":
            return export.gguf_file(self.cfg, params, os.fspath(path), dtype or "f32", what=self.source)
        export.hf_directory(self.cfg, params, os.fspath(path), dtype=dtype, max_shard_size=max_shard_size,
                            adapter=adapter, what=self.source)
