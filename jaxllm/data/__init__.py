"""Data: tokenizers, llm.c shards, corpora (train/val token streams) and mesh-independent batches."""

from jaxllm.data.corpus import Corpus, corpus_summary, load_corpus
from jaxllm.data.loader import batch_rows, eval_batch, global_batch, window_starts
from jaxllm.data.shards import list_shards, read_shard, write_shard
from jaxllm.data.tokenizers import ByteTokenizer, TiktokenTokenizer, get_tokenizer

__all__ = [
    "ByteTokenizer", "TiktokenTokenizer", "get_tokenizer",
    "write_shard", "read_shard", "list_shards",
    "Corpus", "load_corpus", "corpus_summary",
    "window_starts", "batch_rows", "global_batch", "eval_batch",
]
