"""What the training loop reads: one object per `data.format`, with the same four questions answered.

- `train_batch(step, sharding)`: the global batch of step `step` (0-based), depending only on (seed, step);
- `eval_batches(sharding)`: the validation batches (none when `has_validation` is false: `data.val_percent = 0`,
  or too few examples to hold one out);
- `padding_frac(steps)`: the share of padding positions in those steps' batches;
- `steps_per_epoch`: None for text (random windows have no epochs).

`text` is pre-training on windows of a token stream (`corpus.py`, `loader.py`); `chat` and
`prompt_completion` are fine-tuning examples (`examples.py`), `preference` pairs of them (`preference.py`),
in rows (`packing.py`), validated over the whole validation split.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import numpy as np

from jaxllm import batch as batch_lib
from jaxllm.data import chat, corpus as corpus_lib, examples as examples_lib, loader, mixture, packing, preference
from jaxllm.data import streams
from jaxllm.errors import ConfigError, DataError


def check_config(cfg) -> list[str]:
    """The data section and the keys that depend on it, before anything is read."""
    d, t = cfg.data, cfg.train
    for key, choices in (("format", examples_lib.FORMATS), ("loss_on", examples_lib.LOSS_ON),
                         ("truncation", examples_lib.TRUNCATION)):
        if getattr(d, key) not in choices:
            raise ConfigError(f"data.{key}: '{getattr(d, key)}' is not one of {', '.join(choices)}")
    notes = corpus_lib.check_config(d) + preference.check_config(d) + mixture.check_config(d, t.global_batch)
    if d.format != "text" and not os.path.isfile(d.source):
        raise DataError(f"data.source: data.format={d.format} reads a JSONL file, and '{d.source}' is not one")
    if t.epochs < 0:
        raise ConfigError(f"train.epochs: must be 0 or more, got {t.epochs}")
    if t.epochs and d.format == "text":
        raise ConfigError("train.epochs: text is sampled as random windows, which have no epochs; set train.steps, "
                          "or use data.format=chat, prompt_completion or preference")
    if not 0 <= t.warmup_ratio < 1:
        raise ConfigError(f"train.warmup_ratio: must be in [0, 1), got {t.warmup_ratio}")
    if d.val_percent == 0 and t.eval_every:
        notes.append("data.val_percent=0: no validation split, so train.eval_every is ignored")
    return notes


@dataclass
class TextData:
    corpus: corpus_lib.Corpus
    seed: int
    global_batch: int
    seq_len: int
    n_eval: int  # train.eval_batches
    document_mask: bool = False
    steps_per_epoch = None

    @property
    def description(self) -> str:
        return self.corpus.description

    @property
    def has_validation(self) -> bool:
        return len(self.corpus.val) > 0

    @functools.cached_property
    def _docs(self) -> dict:
        """Each split's document starts, where documents are masked (data.document_mask)."""
        return {s: corpus_lib.document_starts(self.corpus, s) if self.document_mask else None for s in ("train", "val")}

    def train_batch(self, step: int, sharding) -> dict:
        return loader.global_batch(self.corpus.train, self.seed, step, self.global_batch, self.seq_len, sharding,
                                   self._docs["train"])

    def eval_batches(self, sharding):
        if self.has_validation:
            for i in range(self.n_eval):
                yield loader.eval_batch(self.corpus.val, i, self.n_eval, self.global_batch, self.seq_len, sharding,
                                        self._docs["val"])

    def padding_frac(self, steps) -> float:
        return 0.0


@dataclass
class ExampleData:
    train: packing.Rows
    val: packing.Rows | None
    seed: int
    global_batch: int
    description: str

    @property
    def steps_per_epoch(self) -> int:
        return packing.steps_per_epoch(len(self.train), self.global_batch)

    @property
    def has_validation(self) -> bool:
        return self.val is not None

    def _array(self, rows: packing.Rows, which: np.ndarray, sharding) -> dict:
        names = tuple(batch_lib.FIELDS) + (packing.PAIR_FIELDS if rows.pairs else ())
        return batch_lib.from_rows(len(which), rows.seq_len, sharding, lambda r: packing.build(rows, which[r]), names)

    def train_batch(self, step: int, sharding) -> dict:
        which = packing.step_rows(len(self.train), self.global_batch, self.seed, step)
        return self._array(self.train, which, sharding)

    def eval_batches(self, sharding):
        if self.val is not None:
            for i in range(packing.steps_per_epoch(len(self.val), self.global_batch)):
                yield self._array(self.val, packing.eval_rows(len(self.val), self.global_batch, i), sharding)

    def padding_frac(self, steps) -> float:
        which = [packing.step_rows(len(self.train), self.global_batch, self.seed, s) for s in steps]
        used = sum(self.train.used(w) for w in which)
        return 1.0 - used / (len(which) * self.global_batch * self.train.seq_len)


def layout(d) -> streams.Layout:
    return streams.Layout(d.add_bos, d.add_eos)


def load(cfg, tokenizer):
    """The data `cfg.data` describes, ready for `cfg.train.global_batch` rows of `cfg.model.seq_len`."""
    d, t, seq = cfg.data, cfg.train, cfg.model.seq_len
    if d.format == "text" and d.sources:
        return mixture.load(cfg, tokenizer, layout(d))
    if d.format == "text":
        corpus = corpus_lib.load_corpus(d.source, tokenizer, d.val_percent, d.text_key, layout(d))
        if d.val_percent == 0:  # shards name their validation files; 0 still means none
            corpus = dataclasses.replace(corpus, val=corpus.val[:0])
        for name, stream in (("train", corpus.train), ("validation", corpus.val)):
            if (len(stream) or name == "train") and len(stream) < seq + 1:
                raise ConfigError(f"data.source {d.source!r}: the {name} split has {len(stream)} tokens, fewer than "
                                  f"model.seq_len+1={seq + 1}; use more data or a shorter model.seq_len")
        return TextData(corpus, t.seed, t.global_batch, seq, t.eval_batches, d.document_mask)
    # read when a line needs it
    template = functools.cache(lambda: chat.load_template(d.chat_template, tokenizer, d.chat_template_kwargs))
    if d.format == "preference":
        every = preference.read_pairs(d.source, d, tokenizer, template)
        kept, truncated, dropped = preference.fit(every, seq, d.truncation, d.source)
    else:
        every = examples_lib.read_examples(d.source, d, tokenizer, template)
        kept, truncated, dropped = examples_lib.fit(every, seq, d.truncation, d.source)
    what = "pair" if d.format == "preference" else "example"
    if not kept:
        raise DataError(f"data.source {d.source}: no {what} fits model.seq_len={seq}; raise model.seq_len")
    train, val = examples_lib.split(kept, d.val_percent)
    train_rows = packing.make_rows(train, seq, d.pack, t.seed)
    val_rows = packing.make_rows(val, seq, d.pack, 0) if val else None
    where = template().source if template.cache_info().currsize else "no template"
    description = (f"{d.source} ({d.format}, {where}): {len(train)} train / {len(val)} val {what}s in "
                   f"{len(train_rows)} rows{' (packed)' if d.pack else ''}; {truncated} truncated, {dropped} dropped")
    return ExampleData(train_rows, val_rows, t.seed, t.global_batch, description)


def resolve_schedule(cfg, data) -> list[str]:
    """train.epochs (which wins over train.steps) and train.warmup_ratio, once the rows are known."""
    t, notes = cfg.train, []
    if t.epochs:
        steps = t.epochs * data.steps_per_epoch
        notes.append(f"train.epochs={t.epochs}: {data.steps_per_epoch} steps per epoch, so {steps} steps "
                     f"(train.epochs wins over train.steps={t.steps})")
        t.steps = steps
    if t.warmup_ratio:
        t.warmup_steps = round(t.warmup_ratio * (t.schedule_steps or t.steps))
        notes.append(f"train.warmup_ratio={t.warmup_ratio}: {t.warmup_steps} warm-up steps")
    return notes
