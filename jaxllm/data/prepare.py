"""Tokenize a corpus once into memory-mapped token shards, in parallel, in bounded memory, resumable.

The source's units (`documents.units`: a text file, 16 MB of a JSONL file, a Parquet row group, an Arrow
file) are tokenized by `workers` processes, each unit into its own part file (train and validation tokens and
document lengths) in a work folder beside OUT_DIR; the parts are then joined, in unit order, into shards of at
most `shard_tokens` tokens: NAME_val_000000.bin, ... then NAME_train_..., numbered on, each with its
documents' start offsets (`.docs.npy`), and `prepare.json` (tokenizer, layout, counts). The result depends on
the inputs and options alone, never on the number of workers or on interruptions.

Memory: a worker holds one unit; the joining reads one part at a time. A kill leaves the work folder; the
same command run again keeps the parts already made (the work folder's job.json must equal the new job's:
same files, sizes, modification times and options; otherwise it starts over). A bad input is a DataError
naming the file (and line), and then the work folder is removed: nothing is written.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from jaxllm.data import corpus as corpus_lib, documents, streams
from jaxllm.data.shards import HEADER_BYTES, MAGIC_GPT2, MAGIC_LLAMA3, header
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.errors import DataError


@dataclass(frozen=True)
class Job:
    source: str
    tokenizer: str
    val_percent: float = 5.0
    text_key: str = "text"
    add_bos: bool = True
    add_eos: bool = False
    shard_tokens: int = 100_000_000
    name: str = "data"
    unit_bytes: int = documents.UNIT_BYTES

    @property
    def layout(self) -> streams.Layout:
        return streams.Layout(self.add_bos, self.add_eos)


def work_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.partial"


def _inputs(files: list[str]) -> list:
    """What a resumed job must find unchanged: every input file's path, size and modification time."""
    return [[p, os.path.getsize(p), os.stat(p).st_mtime_ns] for p in files]


# ---------------------------------------------------------------- workers

_WORKER: dict = {}


def _start_worker(job: Job, work: str, lone: bool) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread per worker: the workers are the
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallelism
    _WORKER.update(job=job, work=Path(work), lone=lone, tokenizer=get_tokenizer(job.tokenizer, "--tokenizer"))


def part_path(work: Path, i: int) -> Path:
    return work / f"part_{i:06d}.npz"


def _tokenize(task: tuple[int, documents.Unit]) -> int:
    """Tokenizes unit i into its part file (written whole, then renamed); returns i."""
    i, unit = task
    job, tokenizer = _WORKER["job"], _WORKER["tokenizer"]
    if _WORKER["lone"]:  # one text file: split by bytes, as training from it does
        train, val = corpus_lib.text_file_pieces(Path(unit.path).read_bytes(), tokenizer, job.layout,
                                                 job.val_percent)
    else:
        train, val = streams.split_documents(documents.texts(unit, job.text_key), tokenizer, job.layout,
                                             job.val_percent)
    dtype = streams.token_dtype(tokenizer.vocab_size)
    arrays = {f"{split}_{what}": a for split, pieces in (("train", train), ("val", val))
              for what, a in zip(("tokens", "docs"), pieces.stream(dtype))}
    path = part_path(_WORKER["work"], i)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return i


# ---------------------------------------------------------------- joining parts into shards

class ShardWriter:
    """Writes llm.c shards of at most `limit` tokens from arrays appended in order, with their documents'
    start offsets beside them; each file appears (renamed) only when complete."""

    def __init__(self, folder: Path, name: str, split: str, first_index: int, limit: int, magic: int, dtype):
        self.folder, self.name, self.split, self.limit, self.magic = folder, name, split, limit, magic
        self.dtype, self.index, self.file, self.count, self.docs, self.paths = dtype, first_index, None, 0, [], []

    def add(self, tokens: np.ndarray, docs: np.ndarray) -> None:
        at = 0
        while at < len(tokens):
            if self.file is None:
                self._open()
            take = min(self.limit - self.count, len(tokens) - at)
            self.docs += [self.count + d - at for d in docs[(docs >= at) & (docs < at + take)]]
            self.file.write(np.ascontiguousarray(tokens[at:at + take], self.dtype).tobytes())
            self.count, at = self.count + take, at + take
            if self.count == self.limit:
                self.close()

    def _open(self) -> None:
        self.path = self.folder / f"{self.name}_{self.split}_{self.index:06d}.bin"
        self.file = open(self.path, "wb")
        self.file.write(bytes(HEADER_BYTES))

    def close(self) -> None:
        if self.file is None:
            return
        self.file.seek(0)
        self.file.write(header(self.magic, 1 if self.dtype == np.uint16 else 7, self.count))
        self.file.close()
        np.save(corpus_lib.docs_path(str(self.path)), np.asarray(self.docs, np.int64))
        self.paths.append(self.path)
        self.file, self.count, self.docs, self.index = None, 0, [], self.index + 1


def _join(job: Job, work: Path, n_parts: int, vocab_size: int, into: Path) -> dict:
    """The parts as shards in `into`: validation first (index 0, ...), then train; returns the counts."""
    dtype = streams.token_dtype(vocab_size)
    magic = MAGIC_GPT2 if vocab_size <= 2**16 else MAGIC_LLAMA3
    counts, index = {}, 0
    for split in ("val", "train"):
        writer = ShardWriter(into, job.name, split, index, job.shard_tokens, magic, dtype)
        tokens = docs = 0
        for i in range(n_parts):
            with np.load(part_path(work, i)) as part:
                t, d = part[f"{split}_tokens"], part[f"{split}_docs"]
            writer.add(t, d)
            tokens, docs = tokens + len(t), docs + len(d)
        writer.close()
        counts[split] = {"tokens": tokens, "documents": docs, "shards": len(writer.paths)}
        index = writer.index
    for split, what in (("train", "training"), ("val", "validation")):
        if not counts[split]["tokens"] and (split == "train" or job.val_percent > 0):
            raise DataError(f"{job.source}: no {what} document among the inputs; give more documents or change "
                            "the validation share (--val-percent)")
    return counts


# ---------------------------------------------------------------- the job

def _resumable(work: Path, plan: dict) -> bool:
    try:
        return json.loads((work / "job.json").read_text()) == plan
    except (OSError, ValueError):
        return False


def prepare(job: Job, out_dir: Path, workers: int = 1, progress=None) -> dict:
    """Runs the job into out_dir; returns prepare.json's contents, and how many of the parts were kept from an
    interrupted run (`kept_parts` of `parts`). `progress(done, total)` is told each unit."""
    out_dir = Path(out_dir)
    if list(out_dir.glob("*.bin")):
        raise DataError(f"{out_dir} already holds .bin shards; give an empty or new OUT_DIR, or delete them first")
    tokenizer = get_tokenizer(job.tokenizer, "--tokenizer")
    corpus_lib.check_source(job.source, "INPUT")
    files = documents.source_files(job.source)
    units = documents.units(files, job.unit_bytes)
    plan = {"job": asdict(job), "inputs": _inputs(files), "units": len(units)}
    work = work_dir(out_dir)
    if not _resumable(work, plan):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        (work / "job.json").write_text(json.dumps(plan))
    try:
        return _run(job, plan, work, units, files, tokenizer, out_dir, workers, progress)
    except BaseException as e:
        if isinstance(e, DataError):  # a bad input: nothing stays written (a kill, though, keeps the parts)
            shutil.rmtree(work, ignore_errors=True)
        raise


def _run(job, plan, work, units, files, tokenizer, out_dir, workers, progress) -> dict:
    todo = [(i, u) for i, u in enumerate(units) if not part_path(work, i).is_file()]
    done = len(units) - len(todo)
    init = (job, str(work), corpus_lib.lone_text_file(files))
    if workers <= 1:
        _start_worker(*init)
        results = map(_tokenize, todo)
    else:
        pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, init)
        results = pool.imap_unordered(_tokenize, todo)
    try:
        for _ in results:
            done += 1
            if progress:
                progress(done, len(units))
    finally:
        if workers > 1:
            pool.terminate()
    final = work / "shards"
    shutil.rmtree(final, ignore_errors=True)
    final.mkdir()
    counts = _join(job, work, len(units), tokenizer.vocab_size, final)
    manifest = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "source": job.source,
                "text_key": job.text_key, "add_bos": job.add_bos, "add_eos": job.add_eos,
                "val_percent": job.val_percent, **counts}
    (final / corpus_lib.PREPARED).write_text(json.dumps(manifest, indent=1) + "\n")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        for f in final.iterdir():
            os.replace(f, out_dir / f.name)
    else:
        os.rename(final, out_dir)
    shutil.rmtree(work, ignore_errors=True)
    return {**manifest, "kept_parts": len(units) - len(todo), "parts": len(units)}
