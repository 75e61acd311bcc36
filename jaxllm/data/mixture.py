"""A mixture of text sources (`data.sources`): which rows of each step come from which source, and which windows.

Shares: source i's rows through step s (of stage weights w, normalised) are the largest-remainder
apportionment of s·B·wᵢ (B = train.global_batch), computed in exact fractions: ⌊s·B·wᵢ⌋ each, and one more for
the sources with the largest remainders (ties to the earlier source). So each source's cumulative row count is
within one row of s·B·wᵢ at every step. A step's rows are the difference of two steps' counts, which is never
negative when B·wᵢ ≥ 1 for every source (checked: below that a source could lose a row it already had).

Windows: source i's training stream is cut into windows of seq_len+1 tokens at a stride of seq_len; its k-th
row overall is window perm(e)[k mod n], e = k div n, with perm(e) a permutation drawn from (seed, i, e): every
window once per epoch of that source, in an order of its own. A step's rows (source by source, in order) depend
on (seed, step, stages) alone, so a run resumes and rescales over any number of processes bitwise.

Stages: weights may change when a run resumes; the counts of the new weights start from that step (the rows
each source had before are kept). The stages, [[start step, weights], ...], are saved in each checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from jaxllm import batch as batch_lib
from jaxllm.data import corpus as corpus_lib, loader, streams
from jaxllm.errors import ConfigError

SOURCE_KEYS = {"path", "weight", "name", "text_key"}


def apportion(n: int, weights: list) -> np.ndarray:
    """Largest-remainder apportionment of n rows to `weights` (exact: weights as the decimals they are written)."""
    w = [Fraction(repr(float(x))) for x in weights]
    quota = [n * x / sum(w) for x in w]
    base = [q.numerator // q.denominator for q in quota]
    order = sorted(range(len(w)), key=lambda i: (-(quota[i] - base[i]), i))
    for i in order[:n - sum(base)]:
        base[i] += 1
    return np.asarray(base, np.int64)


def consumed(stages: list, step: int, global_batch: int) -> np.ndarray:
    """Rows of each source in steps [0, step) under `stages` ([[start, weights], ...], starts increasing)."""
    total = np.zeros(len(stages[0][1]), np.int64)
    for (start, weights), nxt in zip(stages, [s for s, _ in stages[1:]] + [None]):
        end = step if nxt is None else min(step, nxt)
        if end > start:
            total += apportion((end - start) * global_batch, weights)
    return total


def names(sources: list) -> list[str]:
    return [s.get("name") or os.path.basename(str(s["path"]).rstrip("/")) or f"source{i}"
            for i, s in enumerate(sources)]


def check_config(d, global_batch: int) -> list[str]:
    """data.sources: tables with a path and a positive weight, unique names, at least one row per step each."""
    if not d.sources:
        return []
    if d.format != "text":
        raise ConfigError(f"data.sources: mixtures are of text (pre-training) sources, not data.format={d.format}; "
                          "use data.source")
    for i, s in enumerate(d.sources):
        where = f"data.sources[{i}]"
        if not isinstance(s, dict) or not {"path", "weight"} <= set(s) or set(s) - SOURCE_KEYS:
            raise ConfigError(f"{where}: must be a table with path and weight (and optionally name, text_key), got "
                              f"{s!r}; e.g. {{path = \"web.jsonl\", weight = 0.7}}")
        w = s["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise ConfigError(f"{where}.weight: must be a positive number, got {w!r}")
        corpus_lib.check_source(str(s["path"]), f"{where}.path")
    total = sum(s["weight"] for s in d.sources)
    for i, s in enumerate(d.sources):
        if global_batch * s["weight"] / total < 1:
            raise ConfigError(f"data.sources[{i}]: weight {s['weight']} gives {global_batch * s['weight'] / total:.2f}"
                              f" rows of each train.global_batch={global_batch}; a source needs at least one row "
                              "per step (weight ≥ total/global_batch) for its share to stay within one row")
    taken = names(d.sources)
    if len(set(taken)) < len(taken):
        raise ConfigError(f"data.sources: two sources are named alike ({', '.join(taken)}); give each a `name`")
    return ["data.sources is set: data.source is not read"] if d.source != "stdlib" else []


@dataclass
class Source:
    name: str
    corpus: corpus_lib.Corpus
    train_docs: np.ndarray | None
    val_docs: np.ndarray | None
    n_windows: int


@dataclass
class MixtureData:
    sources: list[Source]
    stages: list  # [[start step, weights], ...]
    seed: int
    global_batch: int
    seq_len: int
    n_eval: int
    description: str
    steps_per_epoch = None
    _perms: dict = field(default_factory=dict)

    @property
    def has_validation(self) -> bool:
        return any(len(s.corpus.val) for s in self.sources)

    def resume_stages(self, meta: dict, start: int) -> list[str]:
        """The stages of a run resumed from a checkpoint with metadata `meta`: its stages, and a new one from `start`
        if the weights changed. The sources must be the same, by name and in order."""
        weights, saved = self.stages[-1][1], meta.get("data_stages")
        before = names(meta.get("config", {}).get("data", {}).get("sources") or [])
        if before and before != [s.name for s in self.sources]:
            raise ConfigError(f"data.sources: the run was trained on {before}, not {[s.name for s in self.sources]}; "
                              "resume with the same sources in the same order (their weights may change)")
        self.stages = [list(s) for s in saved] if saved else [[0, weights]]
        if self.stages[-1][1] != weights:
            self.stages = [s for s in self.stages if s[0] < start] + [[start, weights]]
            return [f"data.sources: new weights {weights} from step {start} (the rows before it are kept)"]
        return []

    def _window_starts(self, i: int, first: int, stop: int) -> np.ndarray:
        """Start offsets of source i's rows first..stop-1 (its own count, over all steps)."""
        n = self.sources[i].n_windows
        k = np.arange(first, stop, dtype=np.int64)
        out = np.empty(len(k), np.int64)
        for epoch in np.unique(k // n):
            at = k // n == epoch
            out[at] = self._perm(i, int(epoch))[k[at] % n] * self.seq_len
        return out

    def _perm(self, i: int, epoch: int) -> np.ndarray:
        if (i, epoch) not in self._perms:
            if len(self._perms) > 2 * len(self.sources):  # the epochs in use: at most two per source at a time
                self._perms.clear()
            self._perms[i, epoch] = np.random.default_rng([self.seed, i, epoch]).permutation(self.sources[i].n_windows)
        return self._perms[i, epoch]

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window start) of each row of step `step` (0-based), source by source."""
        before = consumed(self.stages, step, self.global_batch)
        after = consumed(self.stages, step + 1, self.global_batch)
        which = np.repeat(np.arange(len(self.sources)), after - before)
        starts = np.concatenate([self._window_starts(i, before[i], after[i]) for i in range(len(self.sources))])
        return which, starts

    def train_batch(self, step: int, sharding) -> dict:
        which, starts = self.rows(step)

        def build(rows: slice) -> dict:
            parts = []
            for i in np.unique(which[rows]):
                mine = starts[rows][which[rows] == i]
                s = self.sources[i]
                parts.append(loader.window_fields(s.corpus.train, mine, self.seq_len, s.train_docs))
            return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

        return batch_lib.from_rows(len(starts), self.seq_len, sharding, build)

    def eval_sources(self, sharding) -> dict:
        """Each source's validation batches (as text's: evenly spaced windows), by name."""
        def batches(s: Source):
            for j in range(self.n_eval):
                yield loader.eval_batch(s.corpus.val, j, self.n_eval, self.global_batch, self.seq_len, sharding,
                                        s.val_docs)

        return {s.name: batches(s) for s in self.sources if len(s.corpus.val)}

    def eval_batches(self, sharding):
        for batches in self.eval_sources(sharding).values():
            yield from batches

    def source_metrics(self, step: int) -> dict:
        """Tokens each source gave and its epochs, through step `step` (1-based: after `step` steps)."""
        rows = consumed(self.stages, step, self.global_batch)
        out = {}
        for s, r in zip(self.sources, rows):
            out[f"tokens/{s.name}"] = float(r * self.seq_len)
            out[f"epochs/{s.name}"] = float(r / s.n_windows)
        return out

    def padding_frac(self, steps) -> float:
        return 0.0


def load(cfg, tokenizer, layout: streams.Layout) -> MixtureData:
    """The sources of `cfg.data.sources`, each loaded as `data.source` would be."""
    d, t, seq = cfg.data, cfg.train, cfg.model.seq_len
    sources = []
    for name, s in zip(names(d.sources), d.sources):
        corpus = corpus_lib.load_corpus(str(s["path"]), tokenizer, d.val_percent, s.get("text_key", d.text_key),
                                        layout)
        if len(corpus.train) < seq + 1:
            raise ConfigError(f"data.sources {name!r}: its train split has {len(corpus.train)} tokens, fewer than "
                              f"model.seq_len+1={seq + 1}; use more data or a shorter model.seq_len")
        if len(corpus.val) < seq + 1 or d.val_percent == 0:  # too short to validate on (or none asked for)
            corpus = dataclasses.replace(corpus, val=corpus.val[:0])
        docs = functools.partial(corpus_lib.document_starts, corpus)
        sources.append(Source(name, corpus, docs("train") if d.document_mask else None,
                              docs("val") if d.document_mask and len(corpus.val) else None,
                              (len(corpus.train) - 1) // seq))
    weights = [float(s["weight"]) for s in d.sources]
    text = ", ".join(f"{s.name} ×{w:g} ({len(s.corpus.train):,} tokens)" for s, w in zip(sources, weights))
    return MixtureData(sources, [[0, weights]], t.seed, t.global_batch, seq, t.eval_batches, f"mixture: {text}")
