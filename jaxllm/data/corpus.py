"""Turns data.source into two token streams (train, validation) held in memory.

Each stream is the concatenation of its documents, each preceded by the tokenizer's end-of-text id,
which is also how llm.c shards are laid out, so both kinds of source look the same to the loader.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jaxllm.data.shards import list_shards, read_shard
from jaxllm.data.tokenizers import check_name as check_tokenizer_name
from jaxllm.errors import DataError

SOURCES_HINT = "give a text file, a folder of text files, a folder of llm.c .bin shards, or 'stdlib'"


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    tokenizer: Any
    description: str


def _check_val_percent(val_percent: float) -> None:
    if not 0 <= val_percent < 100:
        raise DataError(f"data.val_percent: must be at least 0 and below 100, got {val_percent}")


def check_config(d) -> list[str]:
    """The data section, before anything is read: DataError (one line) for a source or tokenizer that cannot work."""
    check_tokenizer_name(d.tokenizer)  # byte, gpt2, or hf:DIR whose folder holds a tokenizer.json
    src = d.source
    if src != "stdlib" and not any(ch in src for ch in "*?[") and not os.path.exists(src):
        raise DataError(f"data.source: no such file or folder '{src}'; give a path, a glob of .bin shards, or 'stdlib'")
    _check_val_percent(d.val_percent)
    return []


def load_corpus(source: str, tokenizer, val_percent: float = 5.0) -> Corpus:
    """Loads `source`: "stdlib", a text file, a folder of text files or of `*.bin` shards, or a glob of shards."""
    _check_val_percent(val_percent)
    source = str(source)
    if source == "stdlib":
        corpus = _stdlib(tokenizer, val_percent)
    elif os.path.isfile(source):
        corpus = _text_file(Path(source), tokenizer, val_percent)
    elif os.path.isdir(source):
        if glob.glob(os.path.join(glob.escape(source), "*.bin")):
            corpus = _shards(source, tokenizer)
        else:
            corpus = _folder(Path(source), tokenizer, val_percent)
    elif any(c in source for c in "*?["):
        corpus = _shards(source, tokenizer)
    else:
        raise DataError(f"data.source: no such file or folder {source!r}; {SOURCES_HINT}")
    for name, stream in (("train", corpus.train), ("validation", corpus.val)):
        if len(stream) < 2 and (name == "train" or val_percent > 0):  # one token is just the end-of-text marker: nothing to learn or measure
            raise DataError(f"data.source {source!r}: the {name} stream has only {len(stream)} tokens; "
                            "give more text or change data.val_percent")
    return corpus


def corpus_summary(corpus: Corpus) -> str:
    """One line for the log."""
    return (f"data: {len(corpus.train):,} train + {len(corpus.val):,} val tokens "
            f"({corpus.tokenizer.name} tokenizer) from {corpus.description}")


def _stream(texts: list[str], tokenizer) -> np.ndarray:
    """The documents as one stream, each one preceded by the end-of-text id."""
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    eot = np.array([tokenizer.eot], dtype=dtype)
    parts = [p for t in texts for p in (eot, tokenizer.encode(t).astype(dtype, copy=False))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _is_val(rel_path: str, val_percent: float) -> bool:
    """Split by file with a hash of its relative path: the same on every machine and run."""
    return zlib.crc32(rel_path.encode("utf-8")) % 10000 < val_percent * 100


def _as_text(data: bytes) -> str | None:
    """The text in `data`, or None where it is binary (NUL bytes) or not UTF-8."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _walk(root: Path, keep: Callable[[str], bool]) -> list[str]:
    """Sorted relative paths (with '/') of the regular files under root that `keep`, skipping hidden ones."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel_folder = Path(folder).relative_to(root)
        for f in files:
            rel = (rel_folder / f).as_posix()
            if not f.startswith(".") and keep(rel) and os.path.isfile(os.path.join(folder, f)):
                found.append(rel)
    return sorted(found)


def _split_files(root: Path, rels: list[str], tokenizer, val_percent: float, label: str) -> Corpus:
    """Reads the text files and splits them by file; binary and non-UTF-8 files are skipped."""
    texts = {}
    for rel in rels:
        text = _as_text((root / rel).read_bytes())
        if text:
            texts[rel] = text
    skipped = len(rels) - len(texts)
    if not texts:
        raise DataError(f"data.source {label!r}: no non-empty UTF-8 text files found; {SOURCES_HINT}")
    if len(texts) == 1:
        rel, text = next(iter(texts.items()))
        return _split_text(text.encode("utf-8"), tokenizer, val_percent, f"{label} (one file: {rel})")
    val = [r for r in texts if _is_val(r, val_percent)]
    train = [r for r in texts if not _is_val(r, val_percent)]
    if val_percent > 0 and (not val or not train):  # too few files for the hash to put some on each side
        val, train = list(texts)[-1:], list(texts)[:-1]
    note = f", {skipped} empty or non-text skipped" if skipped else ""
    return Corpus(train=_stream([texts[r] for r in train], tokenizer), val=_stream([texts[r] for r in val], tokenizer),
                  tokenizer=tokenizer, description=f"{label} ({len(train)} train / {len(val)} val files{note})")


def _stdlib(tokenizer, val_percent: float) -> Corpus:
    """The running interpreter's own standard library sources: ~30 MB of text on every machine, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = _walk(root, lambda rel: rel.endswith(".py") and not {"site-packages", "dist-packages"} & set(rel.split("/")))
    return _split_files(root, rels, tokenizer, val_percent, f"stdlib {root}")


def _folder(root: Path, tokenizer, val_percent: float) -> Corpus:
    return _split_files(root, _walk(root, lambda rel: True), tokenizer, val_percent, str(root))


def _split_text(data: bytes, tokenizer, val_percent: float, label: str) -> Corpus:
    """One text: the last val_percent% of its bytes, cut at a line start, is validation."""
    cut = int(len(data) * (1 - val_percent / 100))
    line = data.rfind(b"\n", 0, cut)
    if line < 0:
        line = data.find(b"\n", cut)
    if val_percent == 0:
        cut = len(data)
    elif line >= 0 and line + 1 < len(data):
        cut = line + 1
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:  # never cut inside a UTF-8 character
        cut += 1
    train, val = data[:cut].decode("utf-8"), data[cut:].decode("utf-8")
    return Corpus(train=_stream([train], tokenizer), val=_stream([val] if val else [], tokenizer), tokenizer=tokenizer,
                  description=f"{label} ({len(train.encode()):,} train / {len(val.encode()):,} val bytes)")


def _text_file(path: Path, tokenizer, val_percent: float) -> Corpus:
    data = path.read_bytes()
    if _as_text(data) is None:
        raise DataError(f"data.source {str(path)!r}: not a UTF-8 text file; {SOURCES_HINT}")
    if not data:
        raise DataError(f"data.source {str(path)!r}: the file is empty; {SOURCES_HINT}")
    return _split_text(data, tokenizer, val_percent, f"text file {path}")


def _shards(source: str, tokenizer) -> Corpus:
    """llm.c shards: validation by name; ids must fit the tokenizer, since the shards carry no tokenizer name."""
    train_paths, val_paths = list_shards(source)

    def load(paths: list[str]) -> np.ndarray:
        arrays = [read_shard(p) for p in paths]
        for path, tokens in zip(paths, arrays):
            top = int(tokens.max()) if tokens.size else -1
            if top >= tokenizer.vocab_size:
                raise DataError(f"shard {path}: token id {top} is outside data.tokenizer={tokenizer.name} "
                                f"(vocab_size {tokenizer.vocab_size}); set data.tokenizer to the tokenizer the "
                                "shards were made with (gpt2 for llm.c's GPT-2 shards)")
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    return Corpus(train=load(train_paths), val=load(val_paths), tokenizer=tokenizer,
                  description=f"shards {source} ({len(train_paths)} train / {len(val_paths)} val files)")
