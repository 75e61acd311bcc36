"""Generate text from a trained run or a Hugging Face model directory, with the KV cache.

    jaxllm generate --from runs/mine --prompt "def fib(n):" --max-new-tokens 64 --temperature 0.8
    jaxllm generate --from hf:DIR --prompt "..." --greedy [key=value ...]

`--from` is a run directory (its config.toml, tokenizer and newest checkpoint, or `--step`) or `hf:DIR`
(the model, its tokenizer.json and generation_config.json's stop ids). Several `--prompt`s generate as
one batch. key=value overrides set run keys: the mesh (`mesh.tp=2`), `precision.compute` (the run's,
bfloat16 unless set), `distributed.*` for several processes. Prints each prompt with its completion on
stdout and the speed on stderr; any problem is one line `error: ...` and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxllm import cli

log = logging.getLogger("jaxllm")


def parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="jaxllm generate", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", required=True, help="a run directory or hf:DIR")
    p.add_argument("--prompt", action="append", required=True, help="text to continue (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument("--greedy", action="store_true", help="the same as --temperature 0")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens only (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of this mass only (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest; 0: the "
                   "parameters it started from)")
    p.add_argument("overrides", nargs="*", help="run keys, e.g. mesh.tp=2 precision.compute=float32")
    return p


def load(source: str, step: int | None, overrides: list[str]):
    """(config, tokenizer, step functions on this mesh, parameters) of a run directory or hf:DIR."""
    import jax

    from jaxllm.config import build_config, parse_overrides
    from jaxllm.errors import ConfigError
    from jaxllm.interop import hf
    from jaxllm.mesh import initialize_distributed
    from jaxllm.train.loop import checkpoint_params, initial_state, resolve
    from jaxllm.cli.hf import step_fns_for

    # generation keeps the parameters on the device, wherever the run stored them between steps
    given = {**cli.OWN_PROCESSES, "memory.offload_params": False, "memory.offload_optimizer": False,
             **parse_overrides(list(overrides))}
    if source.startswith("hf:"):
        cfg = hf.config_for(source[3:], {"data.tokenizer": source, **given})
    elif os.path.isfile(os.path.join(source, "config.toml")):
        cfg = build_config(os.path.join(source, "config.toml"), {"run.dir": source, **given})
    else:
        raise ConfigError(f"--from {source}: not a run directory (no config.toml) nor hf:DIR")
    initialize_distributed(cfg.distributed)
    tokenizer, _, _ = resolve(cfg)
    fns = step_fns_for(cfg)
    if source.startswith("hf:"):
        params = hf.load_params(source[3:], cfg.model, fns.state_shardings.params)
    elif step == 0:  # the run's starting parameters: its init.from, or its seed's random ones
        params = initial_state(cfg, fns).params
    else:  # a LoRA run's: its adapters on its base
        params = checkpoint_params(cfg, fns, source, step)
    log.info("model from %s on %d %s device(s), compute %s", source, jax.device_count(), jax.devices()[0].platform,
             cfg.precision.compute)
    return cfg, tokenizer, fns, params


def run(args) -> None:
    from jaxllm.generate import generate
    from jaxllm.train.loop import completion_text

    cfg, tokenizer, fns, params = load(args.source, args.step, args.overrides)
    prompts = [list(tokenizer.encode(p)) or [tokenizer.eot] for p in args.prompt]
    timings = {}
    done = generate(params, cfg, prompts, args.max_new_tokens, on=fns, temperature=0.0 if args.greedy else
                    args.temperature, top_k=args.top_k, top_p=args.top_p, stop_ids=tokenizer.stop_ids, seed=args.seed,
                    timings=timings)
    for ids, c in zip(prompts, done):
        print(completion_text(tokenizer, ids, c.tokens))
    n = sum(len(c.tokens) for c in done)
    log.info("%d new tokens in %.2f s: %.1f tokens/s (compiling took %.1f s)", n, timings["run_s"],
             n / timings["run_s"], timings["compile_s"])


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_with_overrides(parser(), argv)
    return cli.run(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
