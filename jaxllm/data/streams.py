"""Token streams: documents laid out as one stream of ids with their start offsets, split train/validation.

Layout (`data.add_bos`, `data.add_eos`): by default each document is the end-of-text id followed by its tokens,
as llm.c's shards are; `add_eos` puts the end-of-text id after the document instead (`doc, eot`); `add_bos`
keeps the BOS an `hf:` tokenizer whose tokenizer.json adds one puts at the document's start (false drops it;
byte and gpt2 add none). A document starts at its first token, the leading end-of-text id included.

Split: a document is validation when the CRC-32 of its UTF-8 text falls in the first `val_percent` of the
range, so the split is the same whatever the file format, order or machine, and two copies of one text are
never on both sides.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    add_bos: bool = True
    add_eos: bool = False


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def is_val(text: str, val_percent: float) -> bool:
    return zlib.crc32(text.encode("utf-8")) % 10000 < val_percent * 100


def document_tokens(text: str, tokenizer, layout: Layout) -> np.ndarray:
    """One document's ids in the stream: its tokens and the end-of-text id, before or after them."""
    dtype = token_dtype(tokenizer.vocab_size)
    ids = np.asarray(tokenizer.encode(text), dtype)
    bos = getattr(tokenizer, "bos", None)
    if not layout.add_bos and getattr(tokenizer, "add_bos", False) and len(ids) and ids[0] == bos:
        ids = ids[1:]
    eot = np.array([tokenizer.eot], dtype)
    return np.concatenate([ids, eot] if layout.add_eos else [eot, ids])


@dataclass
class Pieces:
    """Documents tokenized one after another: their ids and lengths."""
    tokens: list
    lengths: list

    def add(self, ids: np.ndarray) -> None:
        self.tokens.append(ids)
        self.lengths.append(len(ids))

    def stream(self, dtype) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document start offsets)."""
        tokens = np.concatenate(self.tokens).astype(dtype, copy=False) if self.tokens else np.zeros(0, dtype)
        return tokens, np.concatenate([[0], np.cumsum(self.lengths[:-1])]).astype(np.int64) \
            if self.lengths else np.zeros(0, np.int64)


def split_documents(texts, tokenizer, layout: Layout, val_percent: float) -> tuple[Pieces, Pieces]:
    """(train, validation) pieces of the documents `texts` yields."""
    train, val = Pieces([], []), Pieces([], [])
    for text in texts:
        (val if is_val(text, val_percent) else train).add(document_tokens(text, tokenizer, layout))
    return train, val


class TokenStream:
    """Several 1-D token arrays (shards, memory-mapped) read as one: `len`, `stream[i]` for an integer array or
    a slice, `np.asarray(stream)`. Nothing is read until indexed, so a corpus of any size opens at once."""

    def __init__(self, parts: list):
        self.parts = [p for p in parts if len(p)]
        self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)
        self.dtype = parts[0].dtype if parts else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self[np.arange(*index.indices(len(self)))]
        index = np.asarray(index, np.int64)
        which = np.searchsorted(self.ends, index, side="right")
        out = np.empty(index.shape, self.dtype)
        for k in np.unique(which):
            at = which == k
            out[at] = self.parts[k][index[at] - (self.ends[k] - len(self.parts[k]))]
        return out

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(p) for p in self.parts]) if self.parts else np.zeros(0, self.dtype)
        return whole.astype(dtype) if dtype is not None else whole

    def tolist(self) -> list:
        return np.asarray(self).tolist()


def stream_of(parts: list):
    """One part as it is; several as a TokenStream."""
    return parts[0] if len(parts) == 1 else TokenStream(parts)
