"""Documents from files, read in bounded memory as units of work: text files, JSONL, Parquet and Arrow.

A source is a text file (one document), a JSONL file (each line's `text_key` field one document), a Parquet
file (each row's `text_key` column), an Arrow file (`.arrow`: IPC stream or file format, as `datasets` writes
them), a `datasets` `save_to_disk` folder (its `state.json` names the Arrow files, read offline with pyarrow;
`datasets` itself is not needed), a folder of such files (every file under it, sorted, hidden ones skipped,
each read by its suffix), or `stdlib`. The same texts in any of these give the same documents in the same order.

A unit is a piece of one file that one worker tokenizes alone: a text file, a byte range of a JSONL file
(cut at line starts), a row group of a Parquet file, an Arrow file. `units(source_files(source))` lists them, in document
order; `texts(unit, text_key)` yields their documents. A bad file or line is a DataError naming it.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from jaxllm.errors import DataError

UNIT_BYTES = 16 << 20  # a JSONL unit's size: big enough to amortise a task, small enough to bound memory
KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass(frozen=True)
class Unit:
    path: str
    kind: str  # text | jsonl | parquet | arrow
    start: int = 0  # jsonl: byte range [start, stop); parquet: row group `start`
    stop: int = -1


def kind_of(path: str) -> str:
    return KINDS.get(Path(path).suffix.lower(), "text")


@functools.cache
def stdlib_files() -> tuple[str, list[str]]:
    """The running interpreter's standard library sources (~30 MB of text on every machine, no download)."""
    root = sysconfig.get_paths()["stdlib"]
    return root, [p for p in walk(root, skip={"site-packages", "dist-packages"}) if p.endswith(".py")]


def walk(root: str, skip: set = frozenset()) -> list[str]:
    """Paths of the regular files under root, sorted by their path relative to it, skipping hidden files and
    folders and the folders named in `skip`."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip]
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        found += [(f if rel == "." else f"{rel}/{f}", os.path.join(folder, f)) for f in files
                  if not f.startswith(".") and os.path.isfile(os.path.join(folder, f))]
    return [path for _, path in sorted(found)]


def source_files(source: str) -> list[str]:
    """The files of a source, in document order."""
    if source == "stdlib":
        return stdlib_files()[1]
    if os.path.isfile(source):
        return [source]
    if not os.path.isdir(source):
        raise DataError(f"data.source {source!r}: no such file or folder; give a text, JSONL, Parquet or Arrow "
                        "file, a folder of them, or 'stdlib'")
    state = Path(source) / "state.json"
    if state.is_file():  # a datasets save_to_disk folder
        try:
            names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{state}: not a datasets state.json ({e}); save the dataset again with "
                            "save_to_disk") from None
        return [os.path.join(source, n) for n in names]
    return walk(source)


def units(files: list[str], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of work of a source's files (`source_files`), in document order."""
    out: list[Unit] = []
    for path in files:
        kind = kind_of(path)
        if kind == "jsonl":
            out += [Unit(path, kind, a, b) for a, b in _line_ranges(path, unit_bytes)]
        elif kind == "parquet":
            out += [Unit(path, kind, g, g + 1) for g in range(_parquet(path).num_row_groups)]
        else:
            out.append(Unit(path, kind))
    return out


def _line_ranges(path: str, unit_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about unit_bytes each, every one starting at a line start."""
    size, cuts = os.path.getsize(path), [0]
    with open(path, "rb") as f:
        while cuts[-1] + unit_bytes < size:
            f.seek(cuts[-1] + unit_bytes)
            f.readline()
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    return list(zip(cuts, cuts[1:] + [size]))


def texts(unit: Unit, text_key: str = "text") -> Iterator[str]:
    """The documents of one unit, in order."""
    if unit.kind == "text":
        text = as_text(Path(unit.path).read_bytes())  # binary and non-UTF-8 files are skipped
        if text:
            yield text
    elif unit.kind == "jsonl":
        yield from _jsonl(unit, text_key)
    elif unit.kind == "parquet":
        for batch in _parquet(unit.path).iter_batches(row_groups=[unit.start], columns=[_column(unit, text_key)]):
            yield from _strings(unit, batch.column(0).to_pylist(), text_key)
    else:
        yield from _arrow(unit, text_key)


def as_text(data: bytes) -> str | None:
    """The text in `data`, or None where it is binary (NUL bytes) or not UTF-8."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _jsonl(unit: Unit, text_key: str) -> Iterator[str]:
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        at = unit.start
        while at < unit.stop:
            line = f.readline()
            at += len(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{unit.path} line {_line_number(unit.path, at - len(line))}: not JSON ({e}); "
                                "fix or remove the line") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                raise DataError(f"{unit.path} line {_line_number(unit.path, at - len(line))}: no string field "
                                f"{text_key!r}; set the text key (data.text_key, --text-key) to the field holding "
                                "the text")
            yield row[text_key]


def _line_number(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def _pyarrow():
    try:
        import pyarrow  # noqa: F401  # Parquet and Arrow only: an optional dependency
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError('reading Parquet or Arrow needs pyarrow: pip install -e ".[data]"') from None
    return pyarrow


def _parquet(path: str):
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); remake or remove it") \
            from None


def _column(unit: Unit, text_key: str) -> str:
    names = _parquet(unit.path).schema_arrow.names
    if text_key not in names:
        raise DataError(f"{unit.path}: no column {text_key!r} (columns: {', '.join(names)}); set the text key "
                        "(data.text_key, --text-key) to the column holding the text")
    return text_key


def _strings(unit: Unit, values: list, text_key: str) -> Iterator[str]:
    for v in values:
        if not isinstance(v, str):
            raise DataError(f"{unit.path}: column {text_key!r} holds {type(v).__name__}, not text; "
                            "set the text key to a string column")
        yield v


def _arrow(unit: Unit, text_key: str) -> Iterator[str]:
    pa = _pyarrow()
    try:
        for batch in _record_batches(pa, pa.memory_map(unit.path)):
            if text_key not in batch.schema.names:
                raise DataError(f"{unit.path}: no column {text_key!r} (columns: {', '.join(batch.schema.names)}); "
                                "set the text key (data.text_key, --text-key) to the column holding the text")
            yield from _strings(unit, batch.column(text_key).to_pylist(), text_key)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{unit.path}: not a readable Arrow file ({str(e).splitlines()[0]}); remake or remove it") \
            from None


def _record_batches(pa, source) -> Iterator:
    """The record batches of an Arrow IPC stream (what `datasets` writes) or IPC file (Feather v2, what
    `pyarrow.ipc.new_file`, pandas' `to_feather` and polars' `write_ipc` write), compressed or not."""
    try:
        stream = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:  # the random-access file format starts with its magic, not a stream message
        source.seek(0)
        file = pa.ipc.open_file(source)
        stream = (file.get_batch(i) for i in range(file.num_record_batches))
    yield from stream
