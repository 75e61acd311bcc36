"""Tokenizers: a byte-level one that always works offline, and GPT-2 BPE through tiktoken.

A tokenizer is a frozen object with `name`, `vocab_size` (real, unpadded), `eot` (end-of-text id),
`encode(text) -> np.ndarray` (no EOT added) and `decode(ids) -> str`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxllm.errors import DataError

EOT_TEXT = "<|endoftext|>"  # how decode() renders the end-of-text token, as tiktoken does


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; 256 marks end of text. Needs no files, so it works anywhere."""

    name: str = "byte"
    vocab_size: int = 257
    eot: int = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        cuts = np.flatnonzero(ids == self.eot)
        pieces = np.split(ids, cuts)  # every piece after the first starts with an EOT
        pieces = [pieces[0]] + [p[1:] for p in pieces[1:]]
        return EOT_TEXT.join(bytes(p.astype(np.uint8)).decode("utf-8", errors="replace") for p in pieces)


@dataclass(frozen=True)
class TiktokenTokenizer:
    """A tiktoken encoding (GPT-2 BPE); text is encoded as ordinary text, so a literal
    '<|endoftext|>' in the data does not become the EOT id."""

    name: str
    vocab_size: int
    eot: int
    enc: Any = field(repr=False, compare=False)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.uint16 if self.vocab_size <= 65536 else np.uint32)

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in np.asarray(ids).ravel()], errors="replace")


# tiktoken's gpt2 encoding reads these two files through tiktoken.load.read_file_cached, which looks for
# <cache dir>/sha1(url) and downloads the URL when the file is missing or its sha256 is wrong.
_GPT2_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe":
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json":
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def _tiktoken_cache_dir() -> str:
    """The folder tiktoken reads its cache from (same rule as tiktoken.load.read_file_cached)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _gpt2_files_missing() -> list[str]:
    """URLs whose cached copy is absent or corrupt, i.e. that tiktoken would try to download."""
    cache = _tiktoken_cache_dir()
    if cache == "":  # tiktoken treats an empty cache dir as "never cache, always download"
        return list(_GPT2_FILES)
    missing = []
    for url, sha256 in _GPT2_FILES.items():
        path = os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())
        try:
            with open(path, "rb") as f:
                ok = hashlib.sha256(f.read()).hexdigest() == sha256
        except OSError:
            ok = False
        if not ok:
            missing.append(url)
    return missing


def _gpt2() -> TiktokenTokenizer:
    """GPT-2 BPE; checks the cached files first so that an offline machine fails at once instead of
    hanging on a download."""
    try:
        import tiktoken
    except ImportError:
        raise DataError("data.tokenizer=gpt2 needs tiktoken, which is not installed; "
                        "pip install 'jaxllm[gpt2]', or use data.tokenizer=byte") from None
    missing = _gpt2_files_missing()
    if missing:
        cache = _tiktoken_cache_dir() or "<TIKTOKEN_CACHE_DIR is empty>"
        raise DataError(f"data.tokenizer=gpt2: tiktoken's gpt2 files are not cached in {cache} "
                        f"(missing {', '.join(u.rsplit('/', 1)[1] for u in missing)}) and would be downloaded; "
                        "run tiktoken.get_encoding('gpt2') once on a machine with internet and copy its cache "
                        "folder to TIKTOKEN_CACHE_DIR, or use data.tokenizer=byte")
    enc = tiktoken.get_encoding("gpt2")
    return TiktokenTokenizer(name="gpt2", vocab_size=enc.n_vocab, eot=enc.eot_token, enc=enc)


TOKENIZERS = {"byte": ByteTokenizer, "gpt2": _gpt2}


def get_tokenizer(name: str):
    """The tokenizer called `name` ("byte" or "gpt2")."""
    if name not in TOKENIZERS:
        raise DataError(f"data.tokenizer: unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()
