"""llm.c token shards, so that data tokenized once (here or by llm.c's scripts) is reused as is.

Format: a 1024-byte header of 256 little-endian int32 ([0] magic, [1] version, [2] token count,
rest zero), then the tokens as a raw little-endian array: uint16 for version 1, uint32 for version 7.
Every document starts with the end-of-text token. By convention shard 0 is validation
(NAME_val_000000.bin) and the rest train (NAME_train_000001.bin, ...).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np

from jaxllm.errors import DataError

MAGIC_GPT2 = 20240520  # llm.c's magic for GPT-2 token shards; jaxllm also uses it for byte tokens
MAGIC_LLAMA3 = 20240801
MAGICS = (MAGIC_GPT2, MAGIC_LLAMA3)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
DTYPES = {1: np.dtype("<u2"), 7: np.dtype("<u4")}  # version -> token dtype


def write_shard(path, tokens: np.ndarray, magic: int = MAGIC_GPT2) -> None:
    """Writes `tokens` as one shard, atomically (temp file then rename), so readers never see half a file."""
    tokens = np.asarray(tokens).ravel()
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError("write_shard: token ids must be in [0, 2**32)")
    if tokens.size >= 2**31:
        raise ValueError("write_shard: at most 2**31-1 tokens per shard (the header stores an int32 count)")
    version = 1 if tokens.size == 0 or tokens.max() < 2**16 else 7
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header(magic, version, tokens.size))
            f.write(tokens.astype(DTYPES[version]).tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def header(magic: int, version: int, count: int) -> bytes:
    """A shard's 1024-byte header."""
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    ints[:3] = magic, version, count
    return ints.tobytes()


def read_shard(path) -> np.ndarray:
    """The tokens of one shard as a read-only memmap (nothing is read until used)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"shard {path}: cannot read it ({e.strerror}); check the path") from None
    if size < HEADER_BYTES:
        raise DataError(f"shard {path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
                        "the file is truncated or not an llm.c shard, so remake or remove it")
    magic, version, count = np.fromfile(path, dtype="<i4", count=3)
    if magic not in MAGICS:
        raise DataError(f"shard {path}: magic number {magic}, expected one of {MAGICS}; "
                        "it is not an llm.c token shard, so remove it from the data folder")
    if version not in DTYPES:
        raise DataError(f"shard {path}: unknown version {version} (known: 1 = uint16, 7 = uint32); "
                        "remake it with jaxllm prepare-data")
    dtype = DTYPES[int(version)]
    expected = HEADER_BYTES + int(count) * dtype.itemsize
    if count < 0 or size != expected:
        raise DataError(f"shard {path}: header says {count} tokens ({expected} bytes) but the file has {size} bytes; "
                        "the file is truncated or corrupt, so remake it")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(int(count),))


def list_shards(folder_or_glob) -> tuple[list[str], list[str]]:
    """(train_paths, val_paths) of the `*.bin` shards in a folder or matching a glob, sorted;
    a file whose name contains "val" is validation."""
    source = str(folder_or_glob)
    pattern = os.path.join(source, "*.bin") if os.path.isdir(source) else source
    paths = sorted(p for p in glob.glob(pattern) if os.path.isfile(p) and p.endswith(".bin"))
    val = [p for p in paths if "val" in os.path.basename(p)]
    train = [p for p in paths if "val" not in os.path.basename(p)]
    if not train or not val:
        missing = "train" if not train else "validation"
        raise DataError(f"data.source: no {missing} shards in {source!r} ({len(train)} train, {len(val)} val); "
                        "shards with 'val' in their name are validation and the others train, "
                        "so add the missing ones (jaxllm prepare-data writes both)")
    return train, val
