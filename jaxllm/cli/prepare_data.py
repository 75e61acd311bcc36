"""Tokenize a text file, a folder of text files or "stdlib" once into llm.c shards, so that training
starts without re-tokenizing and the shards can be shared with llm.c.

    jaxllm prepare-data INPUT OUT_DIR [--tokenizer byte|gpt2|hf:DIR] [--name NAME]
                                      [--shard-tokens N] [--val-percent P]

Writes NAME_val_000000.bin (validation), then NAME_train_000001.bin, ... of at most N tokens each.
The magic is llm.c's GPT-2 one (20240520) for every tokenizer whose ids fit in uint16 (byte and gpt2
both do), as llm.c's readers only accept that magic with version-1 shards; larger vocabularies get the
LLaMA-3 magic (20240801) with uint32 tokens. Shards are written to a temporary folder next to OUT_DIR
and moved in only when all are done, so a failure leaves no partial files.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from jaxllm.cli import ArgumentParser
from jaxllm.data.corpus import corpus_summary, load_corpus
from jaxllm.data.shards import MAGIC_GPT2, MAGIC_LLAMA3, write_shard
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.errors import DataError


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="jaxllm prepare-data", description=__doc__.split("\n\n")[0])
    p.add_argument("input", help='a text file, a folder of text files, or "stdlib"')
    p.add_argument("out_dir", help="folder to write the .bin shards to (created if missing)")
    p.add_argument("--tokenizer", default="byte", help="byte, gpt2, or hf:DIR (a Hugging Face tokenizer.json folder)")
    p.add_argument("--name", default=None, help="shard file prefix (default: the input's name)")
    p.add_argument("--shard-tokens", type=_positive_int, default=100_000_000, help="max tokens per shard")
    p.add_argument("--val-percent", type=float, default=5.0, help="percent of the data kept for validation")
    return p.parse_args(argv)


def shard_plan(name: str, val: np.ndarray, train: np.ndarray, shard_tokens: int) -> list[tuple[str, np.ndarray]]:
    """(file name, tokens) of every shard: validation first (index 0), then train, numbered on."""
    chunks = [("val", val[i:i + shard_tokens]) for i in range(0, len(val), shard_tokens)]
    chunks += [("train", train[i:i + shard_tokens]) for i in range(0, len(train), shard_tokens)]
    return [(f"{name}_{split}_{i:06d}.bin", tokens) for i, (split, tokens) in enumerate(chunks)]


def prepare(args: argparse.Namespace) -> str:
    """Writes the shards and returns the summary line."""
    out_dir = Path(args.out_dir)
    if glob.glob(os.path.join(glob.escape(str(out_dir)), "*.bin")):
        raise DataError(f"{out_dir} already holds .bin shards; give an empty or new OUT_DIR, or delete them first")
    tokenizer = get_tokenizer(args.tokenizer)
    corpus = load_corpus(args.input, tokenizer, args.val_percent)
    name = args.name or Path(args.input.rstrip("/")).stem or "data"
    magic = MAGIC_GPT2 if tokenizer.vocab_size <= 2**16 else MAGIC_LLAMA3
    plan = shard_plan(name, corpus.val, corpus.train, args.shard_tokens)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}.tmp"  # same file system, so the moves are renames
    tmp.mkdir()
    try:
        for file_name, tokens in plan:
            write_shard(tmp / file_name, tokens, magic=magic)
        if out_dir.exists():
            for file_name, _ in plan:
                os.replace(tmp / file_name, out_dir / file_name)
        else:
            os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return f"wrote {len(plan)} shards (magic {magic}) to {out_dir}: {corpus_summary(corpus)}"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        print(prepare(args))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
