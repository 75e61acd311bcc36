"""A model's parameters written where other tools read them: a Hugging Face model directory, a GGUF file, or a
LoRA run's adapters as a PEFT adapter directory (`jaxllm.load(...).export`, `jaxllm hf export`)."""

from __future__ import annotations

import logging
import os

from jaxllm.errors import ConfigError
from jaxllm.interop import gguf_io, hf, hf_config, peft
from jaxllm.models import lora

log = logging.getLogger("jaxllm")


def hf_directory(cfg, params, out_dir: str, dtype: str | None = None, max_shard_size: str = "5GB",
                 adapter: bool = False, what: str = "the model") -> None:
    """Write `params` (of `cfg.model`, as a run stores them) as a directory transformers' `from_pretrained` loads,
    in `dtype` (default: that of the checkpoint `init.from` names; float32 for random weights), with that
    checkpoint's generation config and the run's Hugging Face tokenizer files; a LoRA model's adapters merged
    in, or with `adapter` its adapters alone as a PEFT adapter directory for its base. `what` names the model
    in messages. Nothing is written when it cannot be exported."""
    hf_config.exportable(cfg.model)
    if adapter and not cfg.model.lora.rank:
        raise ConfigError(f"adapter export: {what} trains no adapters (model.lora.rank = 0); export the model whole")
    source = cfg.init.from_[3:] if cfg.init.from_.startswith("hf:") else None
    if adapter:
        peft.save_adapter(params, cfg.model, out_dir, source)
        log.info("exported %s's adapters to %s (PEFT)", what, out_dir)
        return
    tokenizer = cfg.data.tokenizer[3:] if cfg.data.tokenizer.startswith("hf:") else None
    dtype = dtype or (hf.source_dtype(source) if source else "float32")
    if cfg.model.lora.rank:  # the adapters merged into their weights: a plain model of the base's architecture
        params = peft.merged(params)
    hf.save_pretrained(params, lora.base_model(cfg.model), out_dir, dtype=dtype, max_shard_size=max_shard_size,
                       source=source, tokenizer=tokenizer)
    log.info("exported %s to %s (%s)%s", what, out_dir, dtype,
             "" if tokenizer else "; the run used no Hugging Face tokenizer, so the export has none")


def gguf_file(cfg, params, path: str, dtype: str = "f32", what: str = "the model") -> None:
    """Write `params` (of `cfg.model`; a LoRA model's adapters merged in) as a GGUF file llama.cpp reads, in `dtype`
    (`gguf_io.OUT_TYPES`), with the tokenizer and chat template of the run's tokenizer where it is a GGUF file's.
    Written to `path`.partial and renamed, so `path` is whole or absent."""
    m = lora.base_model(cfg.model)
    hf_config.exportable(m)
    if cfg.model.lora.rank:
        params = peft.merged(params)
    tokenizer = cfg.data.tokenizer
    meta = gguf_io.tokenizer_metadata(tokenizer[5:]) if tokenizer.startswith("gguf:") else None
    partial = path + ".partial"
    gguf_io.write(hf.file_tensors(params, m), hf_config.hf_config(m, "float32"), partial, dtype, meta)
    os.replace(partial, path)
    log.info("exported %s to %s (GGUF, %s)%s", what, path, dtype,
             "" if meta else "; the run used no GGUF tokenizer, so the file carries none")
