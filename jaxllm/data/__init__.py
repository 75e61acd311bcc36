"""Data: tokenizers, token shards, corpora (train/val token streams), mixtures and mesh-independent batches.

The names below are imported when first used, so that what needs no jax (preparing token shards, in worker
processes) does not import it."""

import importlib

_WHERE = {
    "ByteTokenizer": "tokenizers", "TiktokenTokenizer": "tokenizers", "get_tokenizer": "tokenizers",
    "write_shard": "shards", "read_shard": "shards", "list_shards": "shards",
    "Corpus": "corpus", "load_corpus": "corpus", "corpus_summary": "corpus",
    "window_starts": "loader", "batch_rows": "loader", "global_batch": "loader", "eval_batch": "loader",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxllm.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxllm.data.{_WHERE[name]}"), name)
