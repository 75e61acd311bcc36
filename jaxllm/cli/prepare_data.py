"""Tokenize a corpus once into token shards, so that training starts without tokenizing and the shards can
be shared with llm.c.

    jaxllm prepare-data INPUT OUT_DIR [--tokenizer byte|gpt2|hf:DIR] [--workers N] [--text-key KEY]
                                      [--name NAME] [--shard-tokens N] [--val-percent P] [--add-eos] [--no-bos]

INPUT: a text file, a JSONL, Parquet or Arrow file, a datasets `save_to_disk` folder, a folder of such files,
or "stdlib". Writes NAME_val_000000.bin, ... (validation), then NAME_train_..., numbered on, of at most N
tokens each, each with its documents' start offsets (.docs.npy), and prepare.json. The magic is llm.c's GPT-2
one (20240520, uint16 tokens) for every tokenizer whose ids fit in uint16, as llm.c's readers only accept that
magic with version-1 shards; larger vocabularies get the LLaMA-3 magic (20240801) with uint32 tokens.
N worker processes tokenize (one tokenizer thread each); a killed run picks up where it stopped when run again;
a bad input is one line and leaves nothing written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jaxllm.cli import ArgumentParser, positive_int
from jaxllm.errors import DataError


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="jaxllm prepare-data", description=__doc__.split("\n\n")[0])
    p.add_argument("input", help='a text, JSONL, Parquet or Arrow file, a folder of them, or "stdlib"')
    p.add_argument("out_dir", help="folder to write the .bin shards to (created if missing)")
    p.add_argument("--tokenizer", default="byte", help="byte, gpt2, or hf:DIR (a Hugging Face tokenizer.json folder)")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="tokenizing processes (default: one per core)")
    p.add_argument("--text-key", default="text", help="JSONL field / Parquet or Arrow column holding the text")
    p.add_argument("--name", default=None, help="shard file prefix (default: the input's name)")
    p.add_argument("--shard-tokens", type=positive_int, default=100_000_000, help="max tokens per shard")
    p.add_argument("--val-percent", type=float, default=5.0, help="percent of the documents kept for validation")
    p.add_argument("--add-eos", action="store_true", help="end each document with the end-of-text id instead of "
                                                          "starting it with one (data.add_eos)")
    p.add_argument("--no-bos", action="store_true", help="drop the BOS an hf: tokenizer adds (data.add_bos=false)")
    p.add_argument("--unit-bytes", type=positive_int, default=None,
                   help="bytes of a JSONL file one worker takes at a time (default 16 MiB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from jaxllm.data import prepare as prepare_lib

    args = parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread per process: the workers are the
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallelism (set before any tokenizer runs)
    name = args.name or Path(args.input.rstrip("/")).stem or "data"
    job = prepare_lib.Job(source=args.input, tokenizer=args.tokenizer, val_percent=args.val_percent,
                          text_key=args.text_key, add_bos=not args.no_bos, add_eos=args.add_eos,
                          shard_tokens=args.shard_tokens, name=name,
                          **({"unit_bytes": args.unit_bytes} if args.unit_bytes else {}))
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None and not args.quiet:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=done - 1, desc="tokenize", unit="part", file=sys.stderr)
        if bar is not None:
            bar.update(done - bar.n)

    try:
        if not 0 <= args.val_percent < 100:
            raise DataError(f"--val-percent: must be at least 0 and below 100, got {args.val_percent}")
        made = prepare_lib.prepare(job, Path(args.out_dir), args.workers, progress)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    print(f"wrote {made['val']['shards']} val + {made['train']['shards']} train shards to {args.out_dir}: "
          f"{made['train']['tokens']:,} train tokens in {made['train']['documents']:,} documents, "
          f"{made['val']['tokens']:,} val tokens in {made['val']['documents']:,} ({made['tokenizer']} tokenizer)"
          + (f"; {made['kept_parts']} of {made['parts']} parts kept from an interrupted run" if made["kept_parts"]
             else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
