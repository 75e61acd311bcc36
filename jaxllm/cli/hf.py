"""Hugging Face checkpoints in and out of jaxllm runs.

    jaxllm hf import HF_DIR RUN_DIR [key=value ...]
    jaxllm hf export RUN_DIR OUT_DIR [--step N] [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]
                                     [--adapter] [key=value ...]   (e.g. distributed.* and mesh.* for several processes)

`import` writes RUN_DIR/config.toml (init.from = "hf:HF_DIR", its tokenizer when HF_DIR has one) and a
step-0 checkpoint holding the parameters only; `jaxllm train --config RUN_DIR/config.toml
train.resume=true` then trains it, the optimizer starting fresh. `export` writes RUN_DIR's newest (or
STEP's) parameters as a directory transformers' `from_pretrained` loads, in the dtype of the checkpoint the
run started from (float32 for a run that started from random weights) unless --dtype says otherwise, with
that checkpoint's generation config and the run's tokenizer files when it used `data.tokenizer = "hf:DIR"`.
A LoRA run (`model.lora`) exports its base with the adapters merged in, or with --adapter its adapters alone
as a PEFT adapter directory for the base it started from.
Any problem is one line `error: ...` and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxllm import cli

log = logging.getLogger("jaxllm")


def parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="jaxllm hf", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a Hugging Face model directory -> a jaxllm run directory at step 0")
    imp.add_argument("hf_dir")
    imp.add_argument("run_dir")
    imp.add_argument("overrides", nargs="*", help="run keys, e.g. model.seq_len=2048 mesh.fsdp=8")
    exp = sub.add_parser("export", help="a jaxllm run's parameters -> a Hugging Face model directory")
    exp.add_argument("run_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the newest)")
    exp.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the source's)")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    exp.add_argument("--adapter", action="store_true",
                     help="a LoRA run (model.lora): write its adapters as a PEFT adapter directory rather than the "
                          "model with the adapters merged in")
    exp.add_argument("overrides", nargs="*", help="run keys, e.g. distributed.num_processes=2 mesh.fsdp=8")
    return p


def step_fns_for(cfg):
    import jax

    from jaxllm.config import validate
    from jaxllm.mesh import make_mesh
    from jaxllm.train.step import make_step_fns

    shape, _ = validate(cfg, jax.device_count())
    return make_step_fns(cfg, make_mesh(shape, cfg))


def import_(hf_dir: str, run_dir: str, overrides: list[str]) -> None:
    import jax.numpy as jnp

    from jaxllm.config import parse_overrides, to_dict, to_toml
    from jaxllm.errors import ConfigError
    from jaxllm.interop import hf
    from jaxllm.train import checkpoint as ckpt
    from jaxllm.train.state import PARAMS_ONLY

    given = {"run.dir": run_dir, **parse_overrides(overrides)}
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        given.setdefault("data.tokenizer", f"hf:{hf_dir}")
    cfg = hf.config_for(hf_dir, given)
    if cfg.model.lora.rank:  # a LoRA run's checkpoints hold adapters, its base is read from init.from each time
        raise ConfigError("model.lora: adapters need no import; train with init.from=hf:DIR and the model.lora keys")
    if os.path.exists(run_dir) and os.listdir(run_dir):
        raise ConfigError(f"{run_dir}: exists and is not empty; choose a new run directory")
    fns = step_fns_for(cfg)
    params = hf.load_params(hf_dir, cfg.model, fns.state_shardings.params)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    mngr = ckpt.open_manager(run_dir, keep=1)
    meta = {"config": to_dict(cfg), "step": 0, "state_fields": list(PARAMS_ONLY)}
    ckpt.save(mngr, 0, {"step": jnp.int32(0), "params": params}, meta, checked=cfg.train.checkpoint_checksums)
    mngr.wait_until_finished()
    mngr.close()
    log.info("imported %s into %s (step 0, parameters only); train it with: jaxllm train --config "
             "%s train.resume=true", hf_dir, run_dir, os.path.join(run_dir, "config.toml"))


def export(run_dir: str, out_dir: str, step: int | None = None, dtype: str | None = None,
           max_shard_size: str = "5GB", overrides: list[str] = (), adapter: bool = False) -> None:
    from jaxllm.config import build_config, parse_overrides
    from jaxllm.errors import ConfigError
    from jaxllm.interop import hf, hf_config, peft
    from jaxllm.mesh import initialize_distributed
    from jaxllm.models import lora
    from jaxllm.train.loop import checkpoint_params

    if not os.path.isfile(os.path.join(run_dir, "config.toml")):
        raise ConfigError(f"{run_dir}: no config.toml; give a jaxllm run directory")
    cfg = build_config(os.path.join(run_dir, "config.toml"),
                       {"run.dir": run_dir, **cli.OWN_PROCESSES, **parse_overrides(list(overrides))})
    hf_config.exportable(cfg.model)
    initialize_distributed(cfg.distributed)
    if adapter and not cfg.model.lora.rank:
        raise ConfigError(f"--adapter: {run_dir} trains no adapters (model.lora.rank = 0); export without --adapter")
    fns = step_fns_for(cfg)
    params = checkpoint_params(cfg, fns, run_dir, step)
    source = cfg.init.from_[3:] if cfg.init.from_.startswith("hf:") else None
    if adapter:
        peft.save_adapter(params, cfg.model, out_dir, source)
        log.info("exported %s's adapters to %s (PEFT)", run_dir, out_dir)
        return
    tokenizer = cfg.data.tokenizer[3:] if cfg.data.tokenizer.startswith("hf:") else None
    dtype = dtype or (hf.source_dtype(source) if source else "float32")
    if cfg.model.lora.rank:  # the adapters merged into their weights: a plain model of the base's architecture
        params = peft.merged(params)
    hf.save_pretrained(params, lora.base_model(cfg.model), out_dir, dtype=dtype, max_shard_size=max_shard_size,
                       source=source, tokenizer=tokenizer)
    log.info("exported %s to %s (%s)%s", run_dir, out_dir, dtype,
             "" if tokenizer else "; the run used no Hugging Face tokenizer, so the export has none")


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_with_overrides(parser(), argv)
    if args.command == "import":
        return cli.run(lambda: import_(args.hf_dir, args.run_dir, args.overrides))
    return cli.run(lambda: export(args.run_dir, args.out_dir, args.step, args.dtype, args.max_shard_size,
                                  args.overrides, args.adapter))


if __name__ == "__main__":
    sys.exit(main())
