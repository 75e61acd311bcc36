"""Tokenizers: a byte-level one that always works offline, GPT-2 BPE through tiktoken, and a Hugging Face
tokenizer folder (`hf:DIR`, its tokenizer.json read by the `tokenizers` library, offline).

A tokenizer is a frozen object with `name`, `vocab_size` (real, unpadded), `eot` (end-of-text id),
`stop_ids` (the ids generation stops at: the end-of-text id, and for `hf:DIR` its eos ids),
`encode(text) -> np.ndarray`, `decode(ids) -> str`, and `encode_chat(text) -> (ids, starts, ends)` for the
text a chat template renders: special-token strings become their ids (for byte and GPT-2, the
end-of-text string '<|endoftext|>'), nothing is added, and each token comes with the characters it
covers, so a mask over characters becomes a mask over tokens. `encode` adds no EOT (the corpus puts one before
each document); only an `hf:DIR` tokenizer whose files say so adds a BOS (see HFTokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.errors import DataError, ModelFileError
from jaxllm.interop import gguf_io

EOT_TEXT = "<|endoftext|>"  # how decode() renders the end-of-text token, as tiktoken does


def _byte_offsets(text: str):
    """UTF-8 bytes as ids, each with the (start, end) characters of the character it belongs to."""
    data = text.encode("utf-8")
    char_of_byte = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
    return list(data), char_of_byte, char_of_byte + 1


def _split_on_eot(text: str, eot: int, encode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`encode_chat` for a tokenizer whose text has no special tokens: the end-of-text text (EOT_TEXT, as a
    chat template writes it) becomes the `eot` id; `encode(piece) -> (ids, starts, ends)` does the rest."""
    ids, starts, ends, at = [], [], [], 0
    for i, piece in enumerate(text.split(EOT_TEXT)):
        if i:
            ids.append(eot), starts.append(at), ends.append(at + len(EOT_TEXT))
            at += len(EOT_TEXT)
        p_ids, p_starts, p_ends = encode(piece)
        ids.extend(p_ids), starts.extend(np.asarray(p_starts) + at), ends.extend(np.asarray(p_ends) + at)
        at += len(piece)
    return np.asarray(ids, np.int64), np.asarray(starts, np.int64), np.asarray(ends, np.int64)


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; 256 marks end of text. Needs no files, so it works anywhere."""

    name: str = "byte"
    vocab_size: int = 257
    eot: int = 256

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eot,)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_chat(self, text: str):
        return _split_on_eot(text, self.eot, _byte_offsets)

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

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eot,)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.uint16 if self.vocab_size <= 65536 else np.uint32)

    def encode_chat(self, text: str):
        def pieces(part: str):
            ids = self.enc.encode_ordinary(part)
            _, starts = self.enc.decode_with_offsets(ids)
            return ids, starts, (starts[1:] + [len(part)]) if ids else []

        return _split_on_eot(text, self.eot, pieces)

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


def _gpt2(key: str = "data.tokenizer") -> TiktokenTokenizer:
    """GPT-2 BPE; checks the cached files first so that an offline machine fails at once instead of
    hanging on a download. `key`: what the errors call the setting that chose it."""
    try:
        import tiktoken
    except ImportError:
        raise DataError(f"{key}=gpt2 needs tiktoken, which is not installed; "
                        f"pip install 'jaxllm[gpt2]', or use {key}=byte") from None
    missing = _gpt2_files_missing()
    if missing:
        cache = _tiktoken_cache_dir() or "<TIKTOKEN_CACHE_DIR is empty>"
        raise DataError(f"{key}=gpt2: tiktoken's gpt2 files are not cached in {cache} "
                        f"(missing {', '.join(u.rsplit('/', 1)[1] for u in missing)}) and would be downloaded; "
                        "run tiktoken.get_encoding('gpt2') once on a machine with internet and copy its cache "
                        f"folder to TIKTOKEN_CACHE_DIR, or use {key}=byte")
    enc = tiktoken.get_encoding("gpt2")
    return TiktokenTokenizer(name="gpt2", vocab_size=enc.n_vocab, eot=enc.eot_token, enc=enc)


HF_PREFIX = "hf:"
# transformers' tokenizer-wide special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (PreTrainedTokenizerBase), which its decode applies to non-BPE models."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


@dataclass(frozen=True)
class HFTokenizer:
    """A Hugging Face tokenizer folder, `data.tokenizer = "hf:DIR"`: DIR/tokenizer.json through the `tokenizers`
    library (no transformers, no network), with DIR/tokenizer_config.json (bos_token, eos_token,
    clean_up_tokenization_spaces, split_special_tokens), DIR/special_tokens_map.json (special tokens that
    tokenizer_config.json does not name) and DIR/generation_config.json (eos_token_id, an id or a list;
    bos_token_id). The named special tokens (bos, eos, unk, pad, ...) become special added tokens where they are
    in the vocabulary, as transformers makes them; a bos or eos missing from it is refused.

    encode(text) is what transformers' AutoTokenizer.from_pretrained(DIR).encode(text) gives (add_special_tokens
    on: special-token strings in the text become their ids, and the post-processor adds what it adds) with one
    exception, the BOS rule: a BOS is never doubled. Where the tokenizer adds a BOS itself (`add_bos`: the
    tokenizer.json post-processor prepends it, as LLaMA 3's does) and the text already begins with the BOS
    string, the added one is dropped; jaxllm never adds a BOS the tokenizer does not. A training document
    therefore holds exactly one BOS at its start when the tokenizer adds BOS (the corpus stream is then
    `eot, bos, doc, eot, bos, doc, ...`) and none otherwise (GPT-2 style: `eot, doc, eot, doc, ...`). The
    post-processor is tokenizer.json's alone: tokenizer_config.json's add_bos_token and add_eos_token are ignored,
    as transformers 5 ignores them when there is a tokenizer.json; an EOS the post-processor appends is kept.

    decode(ids) is AutoTokenizer's decode with skip_special_tokens=False: special tokens are rendered as their
    strings; clean_up_tokenization_spaces is applied only to non-BPE models, as transformers 5 does.

    `stop_ids`: tokenizer_config.json's eos first, then generation_config.json's eos_token_id(s) (an id may be
    only there, as LLaMA 3 Instruct's <|eot_id|>); `eot` is the first of them. `bos` is tokenizer_config.json's
    bos_token (else generation_config.json's bos_token_id), or None. `vocab_size` counts every id, added tokens
    included. `source_dir` is DIR as an absolute path, for copying the tokenizer files next to exported weights.
    """

    name: str
    vocab_size: int
    eot: int
    bos: int | None
    stop_ids: tuple[int, ...]
    source_dir: str
    add_bos: bool
    special_texts: dict = field(default_factory=dict, repr=False, compare=False)  # bos_token -> its text, ...
    chat_template: str | None = field(default=None, repr=False)
    clean_up_spaces: bool = field(default=False, repr=False)
    tok: Any = field(default=None, repr=False, compare=False)

    def encode(self, text: str) -> np.ndarray:
        ids = self.tok.encode(text).ids
        if self.add_bos and len(ids) > 1 and ids[0] == ids[1] == self.bos:  # the text brought its own BOS
            ids = ids[1:]
        return np.asarray(ids, dtype=np.uint16 if self.vocab_size <= 65536 else np.uint32)

    def encode_chat(self, text: str):
        enc = self.tok.encode(text, add_special_tokens=False)  # as apply_chat_template tokenizes
        return (np.asarray(enc.ids, np.int64), np.asarray([o[0] for o in enc.offsets], np.int64),
                np.asarray([o[1] for o in enc.offsets], np.int64))

    def decode(self, ids, skip_special: bool = False) -> str:
        """The text of `ids`; special tokens as their strings, or left out (`skip_special`, as transformers'
        `skip_special_tokens=True`)."""
        text = self.tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=skip_special)
        return _clean_up_tokenization(text) if self.clean_up_spaces else text


def _hf_dir(name: str, key: str) -> Path:
    """The folder of `hf:DIR` after the checks that need no parsing: it exists and holds tokenizer.json."""
    spec = name[len(HF_PREFIX):]
    where = f"{key}={name}"
    if not spec:
        raise DataError(f"{where}: names no folder; give hf:DIR with DIR the folder of a Hugging Face tokenizer.json")
    folder = Path(os.path.expanduser(spec))
    if not folder.exists():
        raise DataError(f"{where}: no such folder '{folder}'; give hf:DIR with DIR a folder holding a Hugging Face "
                        "tokenizer.json")
    if not folder.is_dir():
        raise DataError(f"{where}: '{folder}' is not a folder; give the folder that holds tokenizer.json, "
                        f"hf:{folder.parent}")
    if not (folder / "tokenizer.json").is_file():
        sentencepiece = sorted(p.name for p in folder.glob("*.model"))
        if sentencepiece:
            raise DataError(f"{where}: '{folder}' has only a sentencepiece {sentencepiece[0]}, and jaxllm reads "
                            "tokenizer.json; convert it on a machine with transformers: "
                            f"AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}')")
        raise DataError(f"{where}: no tokenizer.json in '{folder}'; give the folder of a Hugging Face tokenizer "
                        "(tokenizer.json, with tokenizer_config.json and generation_config.json beside it)")
    return folder


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text[:200] or type(error).__name__


def _read_json(where: str, path: Path) -> dict:
    """A JSON object from `path`, {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: cannot read {path} ({_one_line(e)}); fix it or remove it") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: {path} holds no JSON object; fix it or remove it")
    return obj


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, a dict with "content", or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def _hf(name: str, key: str) -> HFTokenizer:
    where = f"{key}={name}"
    folder = _hf_dir(name, key)
    try:
        from tokenizers import AddedToken, Tokenizer
    except ImportError:
        raise DataError(f"{where} needs the tokenizers package, which is not installed; pip install tokenizers "
                        f"(or pip install -e . again), or use {key}=byte") from None
    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # the library raises a bare Exception for a malformed file
        raise DataError(f"{where}: cannot read {folder / 'tokenizer.json'} ({_one_line(e)}); replace it with a "
                        "tokenizer.json saved by the tokenizers library or transformers") from None
    config = _read_json(where, folder / "tokenizer_config.json")
    special_map = _read_json(where, folder / "special_tokens_map.json")
    generation = _read_json(where, folder / "generation_config.json")
    tok.no_truncation()  # as transformers' encode without truncation=...: a corpus is encoded whole
    tok.no_padding()
    tok.encode_special_tokens = bool(config.get("split_special_tokens", False))

    # The named special tokens are special added tokens, as transformers makes them (same ids: they are in the
    # vocabulary already); bos and eos must be there, the others are only marked where they are.
    added = {str(t) for t in tok.get_added_tokens_decoder().values()}
    texts = {}
    for key in _NAMED_SPECIAL:
        source = "tokenizer_config.json" if key in config else "special_tokens_map.json"
        value = config[key] if key in config else special_map.get(key)
        text = _token_text(value)
        if text is None:
            continue
        if tok.token_to_id(text) is None:
            if key in ("bos_token", "eos_token"):
                raise DataError(f"{where}: {source}'s {key} {text!r} is not in tokenizer.json's vocabulary; "
                                f"fix {key} in {folder / source}")
            continue
        texts[key] = text
        if text not in added:
            flags = {k: bool(value[k]) for k in ("lstrip", "rstrip", "single_word") if k in value} \
                if isinstance(value, dict) else {}
            tok.add_special_tokens([AddedToken(text, special=True, normalized=False, **flags)])

    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = max(max(vocab.values(), default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))
    bos = tok.token_to_id(texts["bos_token"]) if "bos_token" in texts else None
    eos = tok.token_to_id(texts["eos_token"]) if "eos_token" in texts else None
    if bos is None and _ids(generation.get("bos_token_id")):
        bos = _ids(generation["bos_token_id"])[0]
    stops = [eos] if eos is not None else []
    for i in _ids(generation.get("eos_token_id")) + ([bos] if bos is not None else []):
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise DataError(f"{where}: generation_config.json's token id {i!r} is not an id of the tokenizer "
                            f"(0..{vocab_size - 1}); fix {folder / 'generation_config.json'}")
    for i in _ids(generation.get("eos_token_id")):
        if i not in stops:
            stops.append(i)
    if not stops:
        raise DataError(f"{where}: no end-of-text token: neither tokenizer_config.json's eos_token nor "
                        f"generation_config.json's eos_token_id names one; add eos_token to "
                        f"{folder / 'tokenizer_config.json'}")

    plain, marked = tok.encode("a", add_special_tokens=False).ids, tok.encode("a").ids
    add_bos = bos is not None and len(marked) > len(plain) and marked[:1] == [bos] and plain[:1] != [bos]
    clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and type(tok.model).__name__ != "BPE"
    return HFTokenizer(name=name, vocab_size=vocab_size, eot=stops[0], bos=bos, stop_ids=tuple(stops),
                       source_dir=str(folder.resolve()), add_bos=add_bos, special_texts=texts,
                       chat_template=_chat_template(where, folder, config), clean_up_spaces=clean_up, tok=tok)


def _chat_template(where: str, folder: Path, config: dict) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of named ones
    whose "default" is used), else None."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if value is None:
            raise DataError(f"{where}: tokenizer_config.json's chat_template lists {sorted(map(str, named))} and "
                            "no 'default'; set data.chat_template to the .jinja file of the one to use")
    return value if isinstance(value, str) and value else None


TOKENIZERS = {"byte": lambda key: ByteTokenizer(), "gpt2": _gpt2}  # name -> its maker, given the setting's key
CHOICES = ", ".join([*TOKENIZERS, f"{HF_PREFIX}DIR", "gguf:FILE"])


GGUF_PREFIX = "gguf:"


def _gguf(name: str, key: str) -> HFTokenizer:
    """`data.tokenizer = "gguf:FILE"`: the tokenizer a GGUF file carries in its metadata (`gguf_io.tokenizer`:
    byte-level or SentencePiece BPE, its control tokens special), with its bos, eos, whether llama.cpp adds
    the BOS (`tokenizer.ggml.add_bos_token`) and its chat template (`tokenizer.chat_template`)."""
    path = name[len(GGUF_PREFIX):]
    try:
        meta = gguf_io.file_metadata(path)
        tok = gguf_io.tokenizer(meta)
    except ModelFileError as e:
        raise DataError(f"{key}={name}: {e}") from None
    tok.no_truncation()
    tok.no_padding()
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise DataError(f"{key}={name}: the file names no tokenizer.ggml.eos_token_id; give another tokenizer")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    texts = {"eos_token": tok.id_to_token(int(eos))} | ({"bos_token": tok.id_to_token(int(bos))} if bos is not None
                                                        else {})
    return HFTokenizer(name=name, vocab_size=vocab, eot=int(eos), bos=None if bos is None else int(bos),
                       stop_ids=(int(eos),), source_dir=os.path.dirname(os.path.abspath(path)),
                       add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None,
                       special_texts=texts, chat_template=meta.get("tokenizer.chat_template"), tok=tok)


def check_name(name: str, key: str = "data.tokenizer") -> None:
    """DataError (one line) for a tokenizer name that cannot work, reading no file (`hf:DIR`: the folder and its
    tokenizer.json exist); `key` is what the line calls the setting (`--tokenizer` on prepare-data's command line)."""
    if name.startswith(HF_PREFIX):
        _hf_dir(name, key)
    elif name.startswith(GGUF_PREFIX):
        if not os.path.isfile(name[len(GGUF_PREFIX):]):
            raise DataError(f"{key}={name}: no such GGUF file")
    elif name not in TOKENIZERS:
        raise DataError(f"{key}: unknown tokenizer {name!r}; choose one of {CHOICES}")


def get_tokenizer(name: str, key: str = "data.tokenizer"):
    """The tokenizer called `name`: "byte", "gpt2", "hf:DIR" (a Hugging Face tokenizer folder) or "gguf:FILE" (the
    tokenizer a GGUF file carries). `key`: what an error calls the setting that named it."""
    check_name(name, key)
    if name.startswith(HF_PREFIX):
        return _hf(name, key)
    if name.startswith(GGUF_PREFIX):
        return _gguf(name, key)
    return TOKENIZERS[name](key)
