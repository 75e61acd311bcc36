"""Turns a data source into two token streams (train, validation) and their documents' start offsets.

A stream is its documents one after another, laid out as `streams.py` says (by default each preceded by the
tokenizer's end-of-text id, which is also how llm.c shards are laid out, so both kinds of source look the same
to the loader). Text, JSONL, Parquet and Arrow sources are tokenized here, in memory (`jaxllm prepare-data`
does it once, in parallel, for corpora too big for that); a folder of `.bin` shards is memory-mapped.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.data import documents, streams
from jaxllm.data.shards import list_shards, read_shard
from jaxllm.data.tokenizers import check_name as check_tokenizer_name
from jaxllm.errors import DataError

SOURCES_HINT = ("give a text, JSONL, Parquet or Arrow file, a folder of them, a folder of .bin token shards, "
                "or 'stdlib'")


@dataclass(frozen=True)
class Corpus:
    train: Any  # 1-D token ids: an array, or a TokenStream over shards
    val: Any
    tokenizer: Any
    description: str
    train_docs: np.ndarray | None = None  # each document's start offset; None: where the end-of-text ids are
    val_docs: np.ndarray | None = None


def document_starts(corpus: Corpus, split: str) -> np.ndarray:
    """The start offsets of the documents of `split` (train or val): stored, or for shards made elsewhere (llm.c)
    the positions of the end-of-text ids that begin their documents (one pass over the stream)."""
    docs = corpus.train_docs if split == "train" else corpus.val_docs
    if docs is None:
        docs = np.flatnonzero(np.asarray(getattr(corpus, split)) == corpus.tokenizer.eot).astype(np.int64)
    return docs if len(docs) and docs[0] == 0 else np.concatenate([[0], docs]).astype(np.int64)


def check_source(src: str, key: str = "data.source") -> None:
    if src != "stdlib" and not any(ch in src for ch in "*?[") and not os.path.exists(src):
        raise DataError(f"{key}: no such file or folder '{src}'; {SOURCES_HINT}")


def check_config(d) -> list[str]:
    """The data section, before anything is read: DataError (one line) for a source or tokenizer that cannot work."""
    check_tokenizer_name(d.tokenizer)  # byte, gpt2, or hf:DIR whose folder holds a tokenizer.json
    if not d.sources:
        check_source(d.source)
    _check_val_percent(d.val_percent)
    return []


def _check_val_percent(val_percent: float) -> None:
    if not 0 <= val_percent < 100:
        raise DataError(f"data.val_percent: must be at least 0 and below 100, got {val_percent}")


def load_corpus(source: str, tokenizer, val_percent: float = 5.0, text_key: str = "text",
                layout: streams.Layout = streams.Layout()) -> Corpus:
    """Loads `source`: "stdlib", a text/JSONL/Parquet/Arrow file or a folder of them, a folder of `*.bin`
    shards (with the `.docs.npy` offsets prepare-data writes, where present), or a glob of shards."""
    _check_val_percent(val_percent)
    source = str(source)
    if os.path.isdir(source) and glob.glob(os.path.join(glob.escape(source), "*.bin")):
        corpus = _shards(source, tokenizer, layout)
    elif source != "stdlib" and not os.path.exists(source) and any(c in source for c in "*?["):
        corpus = _shards(source, tokenizer, layout)
    else:
        corpus = _documents(source, tokenizer, val_percent, text_key, layout)
    for name, stream in (("train", corpus.train), ("validation", corpus.val)):
        if len(stream) < 2 and (name == "train" or val_percent > 0):  # one token is just the end-of-text marker: nothing to learn or measure
            raise DataError(f"data.source {source!r}: the {name} stream has only {len(stream)} tokens; "
                            "give more text or change data.val_percent")
    return corpus


def corpus_summary(corpus: Corpus) -> str:
    """One line for the log."""
    return (f"data: {len(corpus.train):,} train + {len(corpus.val):,} val tokens "
            f"({corpus.tokenizer.name} tokenizer) from {corpus.description}")


def lone_text_file(files: list[str]) -> bool:
    """A source of one text file is one document, split by bytes rather than by document."""
    return len(files) == 1 and documents.kind_of(files[0]) == "text"


def _documents(source: str, tokenizer, val_percent: float, text_key: str, layout) -> Corpus:
    files = documents.source_files(source)
    label = f"stdlib {documents.stdlib_files()[0]}" if source == "stdlib" else source
    readable = lambda path: documents.as_text(Path(path).read_bytes()) is not None
    if lone_text_file(files) and (os.path.isfile(source) or readable(files[0])):
        return _text_file(Path(files[0]), tokenizer, val_percent, layout, label)
    texts = (t for unit in documents.units(files) for t in documents.texts(unit, text_key))
    train, val = streams.split_documents(texts, tokenizer, layout, val_percent)
    if not train.lengths and not val.lengths:
        raise DataError(f"data.source {label!r}: no non-empty UTF-8 text documents found; {SOURCES_HINT}")
    dtype = streams.token_dtype(tokenizer.vocab_size)
    (tt, td), (vt, vd) = train.stream(dtype), val.stream(dtype)
    return Corpus(train=tt, val=vt, tokenizer=tokenizer, train_docs=td, val_docs=vd,
                  description=f"{label} ({len(td)} train / {len(vd)} val documents)")


def split_text(data: bytes, val_percent: float) -> tuple[str, str]:
    """One text's (train, validation) parts: the last val_percent% of its bytes, cut at a line start."""
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
    return data[:cut].decode("utf-8"), data[cut:].decode("utf-8")


def text_file_pieces(data: bytes, tokenizer, layout, val_percent: float):
    """(train, validation) pieces of one text file: each part (if any) one document."""
    train, val = streams.Pieces([], []), streams.Pieces([], [])
    for text, pieces in zip(split_text(data, val_percent), (train, val)):
        if text:
            pieces.add(streams.document_tokens(text, tokenizer, layout))
    return train, val


def _text_file(path: Path, tokenizer, val_percent: float, layout, label: str) -> Corpus:
    data = path.read_bytes()
    if documents.as_text(data) is None:
        raise DataError(f"data.source {str(path)!r}: not a UTF-8 text file; {SOURCES_HINT}")
    if not data:
        raise DataError(f"data.source {str(path)!r}: the file is empty; {SOURCES_HINT}")
    dtype = streams.token_dtype(tokenizer.vocab_size)
    (tt, td), (vt, vd) = (p.stream(dtype) for p in text_file_pieces(data, tokenizer, layout, val_percent))
    return Corpus(train=tt, val=vt, tokenizer=tokenizer, train_docs=td, val_docs=vd,
                  description=f"{label} (one text file, {len(data):,} bytes, the last {val_percent:g}% for "
                              "validation)")


def _shards(source: str, tokenizer, layout) -> Corpus:
    """Token shards, memory-mapped: validation by name. The ids must fit the tokenizer: jaxllm's shards name theirs
    and their layout (prepare.json beside them), others (llm.c's) are scanned once for their largest id."""
    train_paths, val_paths = list_shards(source)
    made = prepared(os.path.dirname(train_paths[0]))
    made_with = made and made["tokenizer"]
    if made and made_with != tokenizer.name:
        raise DataError(f"data.source {source!r}: the shards were made with tokenizer {made_with}, not "
                        f"data.tokenizer={tokenizer.name}; set data.tokenizer={made_with} or prepare them again")
    for key in ("add_bos", "add_eos"):
        if made and made[key] != getattr(layout, key):
            raise DataError(f"data.source {source!r}: the shards were made with {key}={made[key]}, not "
                            f"data.{key}={getattr(layout, key)}; set data.{key} to match or prepare them again")

    def load(paths: list[str]):
        arrays = [read_shard(p) for p in paths]
        for path, tokens in zip(paths, arrays if made_with is None else ()):
            top = int(tokens.max()) if tokens.size else -1
            if top >= tokenizer.vocab_size:
                raise DataError(f"shard {path}: token id {top} is outside data.tokenizer={tokenizer.name} "
                                f"(vocab_size {tokenizer.vocab_size}); set data.tokenizer to the tokenizer the "
                                "shards were made with (gpt2 for llm.c's GPT-2 shards)")
        return streams.stream_of(arrays), _shard_docs(paths, arrays)

    (train, train_docs), (val, val_docs) = load(train_paths), load(val_paths)
    return Corpus(train=train, val=val, tokenizer=tokenizer, train_docs=train_docs, val_docs=val_docs,
                  description=f"shards {source} ({len(train_paths)} train / {len(val_paths)} val files)")


PREPARED = "prepare.json"  # what jaxllm prepare-data writes beside its shards


def prepared(folder: str) -> dict | None:
    """prepare.json of a folder of jaxllm's shards, or None for shards made elsewhere."""
    path = Path(folder) / PREPARED
    if not path.is_file():
        return None
    try:
        made = json.loads(path.read_text())
        return {k: made[k] for k in ("tokenizer", "add_bos", "add_eos")}
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: unreadable ({e}); prepare the shards again") from None


def docs_path(shard_path: str) -> str:
    return shard_path[:-len(".bin")] + ".docs.npy"


def _shard_docs(paths: list[str], arrays: list) -> np.ndarray | None:
    """The documents' start offsets over the shards, where every shard has its .docs.npy; else None."""
    if not all(os.path.isfile(docs_path(p)) for p in paths):
        return None
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])[:-1]]).astype(np.int64)
    return np.concatenate([np.load(docs_path(p)) + o for p, o in zip(paths, offsets)]).astype(np.int64)
