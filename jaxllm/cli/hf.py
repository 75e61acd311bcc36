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
    exp.add_argument("--format", default="hf", choices=("hf", "gguf"), help="hf: a Hugging Face model directory "
                     "(default); gguf: a GGUF file (OUT_DIR is then the file) for llama.cpp, Ollama, LM Studio")
    exp.add_argument("--dtype", default=None, help="hf: float32, bfloat16 or float16 (default: the source's); gguf: "
                     "f32 (default), f16, bf16 or q8_0")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    exp.add_argument("--adapter", action="store_true",
                     help="a LoRA run (model.lora): write its adapters as a PEFT adapter directory rather than the "
                          "model with the adapters merged in")
    exp.add_argument("overrides", nargs="*", help="run keys, e.g. distributed.num_processes=2 mesh.fsdp=8")
    return p


def run(args) -> None:
    import jaxllm

    if args.command == "import":
        config = jaxllm.import_hf(args.hf_dir, args.run_dir, args.overrides)
        log.info("imported %s into %s (step 0, parameters only); train it with: jaxllm train --config %s "
                 "train.resume=true", args.hf_dir, args.run_dir, config)
        return
    model = jaxllm.load(args.run_dir, args.step, args.overrides)
    model.export(args.out_dir, args.format, dtype=args.dtype, max_shard_size=args.max_shard_size, adapter=args.adapter)


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_with_overrides(parser(), argv)
    return cli.run(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
