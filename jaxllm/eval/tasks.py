"""Benchmark tasks from small YAML (or JSON) files in lm-evaluation-harness 0.4's own task format, read offline.

A task file names local data (`dataset_path: json` and `dataset_kwargs: {data_files: {SPLIT: FILE}}`, files
relative to the task file, one JSON object per line), the split evaluated (`test_split`, else
`validation_split`) and the one few-shot examples come from (`fewshot_split`), how a document becomes text
(`doc_to_text`, `doc_to_target`, `doc_to_choice`: a column name, or a Jinja template rendered as
lm-evaluation-harness renders it), `output_type` (`multiple_choice`, `loglikelihood_rolling` or `generate_until`
with greedy `generation_kwargs`: `until`, `max_gen_toks`, and a `filter_list` of `regex` and `take_first`),
`num_fewshot`, `description`, `target_delimiter` (" "), `fewshot_delimiter` ("\\n\\n") and `metric_list`.
The same file runs in lm-evaluation-harness (with absolute paths), which is how the tests compare the two.
Anything else in the file is refused in one line: what we do not compute as it does, we do not compute.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from jaxllm.errors import ConfigError, DataError

OUTPUT_TYPES = ("multiple_choice", "loglikelihood_rolling", "generate_until")
METRICS = {"multiple_choice": ("acc", "acc_norm", "acc_bytes"),
           "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
           "generate_until": ("exact_match",)}
DEFAULT_METRICS = {"multiple_choice": ["acc", "acc_norm"],
                   "loglikelihood_rolling": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
                   "generate_until": ["exact_match"]}
KEYS = {"task", "dataset_path", "dataset_kwargs", "test_split", "validation_split", "fewshot_split",
        "training_split", "doc_to_text", "doc_to_target", "doc_to_choice", "output_type", "num_fewshot",
        "description", "target_delimiter", "fewshot_delimiter", "metric_list", "metadata", "generation_kwargs",
        "filter_list"}
EXACT_MATCH_ARGS = {"ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore"}
GENERATION_KEYS = {"until", "max_gen_toks", "do_sample", "temperature"}
FILTERS = {"regex": {"regex_pattern", "group_select", "fallback"}, "take_first": set()}


@dataclass
class Task:
    name: str
    output_type: str
    docs: list[dict]
    fewshot_docs: list[dict] | None
    same_split: bool  # few-shot examples from the evaluated split: a document is never its own example
    spec: dict = field(repr=False)
    num_fewshot: int = 0
    description: str = ""
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    metrics: list[str] = field(default_factory=list)
    metric_args: dict = field(default_factory=dict)  # exact_match's options
    until: list[str] = field(default_factory=list)
    max_gen_toks: int = 256
    filters: dict = field(default_factory=lambda: {"none": [{"function": "take_first"}]})

    def render(self, key: str, doc: dict):
        try:
            return render(self.spec.get(key), doc, key, has_choices="doc_to_choice" in self.spec)
        except DataError as e:
            raise DataError(f"task {self.name}: {e}") from None

    def text(self, doc: dict) -> str:
        return self.render("doc_to_text", doc)

    def target(self, doc: dict):
        return self.render("doc_to_target", doc)

    def choices(self, doc: dict) -> list[str]:
        return self.render("doc_to_choice", doc)


@functools.lru_cache(maxsize=None)
def _template(text: str):
    """A doc_to_* template compiled once (it is rendered for every document, several times)."""
    import jinja2

    return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True).from_string(text)


def render(template, doc: dict, key: str, has_choices: bool):
    """A doc_to_* field of one document, as lm-evaluation-harness 0.4 reads it: a column's value as it is, else
    the template rendered; a target of digits with choices is an index, `[...]` a literal list."""
    if isinstance(template, list):
        return template
    if template in doc:
        return doc[template]
    import jinja2

    try:
        text = _template(template).render(**doc)
        if key == "doc_to_choice":
            return ast.literal_eval(text)
    except (jinja2.TemplateError, ValueError, SyntaxError) as e:
        raise DataError(f"{key} {template!r} on a document of columns {sorted(doc)}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}; fix the template or the data") from None
    if key == "doc_to_target" and has_choices and text.isdigit():
        return int(text)
    if key == "doc_to_target" and text.startswith("[") and text.endswith("]"):
        return ast.literal_eval(text)
    if key == "doc_to_text" and has_choices and text.isdigit():
        return int(text)
    return text


def _read_jsonl(path: Path, where: str) -> list[dict]:
    if not path.is_file():
        raise DataError(f"{where}: no such data file {str(path)!r}; data_files are relative to the task file")
    docs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                docs.append(json.loads(line))
            except ValueError as e:
                raise DataError(f"{path} line {number}: not JSON ({e}); fix or remove the line") from None
    return docs


def _load_file(path: str) -> dict:
    text = Path(path).read_text(encoding="utf-8")
    try:
        if path.endswith(".json"):
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001  # any parse error is the file's, in one line
        raise DataError(f"task file {path}: cannot be parsed ({str(e).splitlines()[0]}); fix its syntax") from None


def first_docs(task: Task, limit: float | None, key: str = "limit") -> Task:
    """The task on its first documents, as lm-evaluation-harness's `limit` takes them: `limit` of them, or below 1
    that share of them rounded up; None: all. Few-shot examples are still drawn from their whole split. A bad
    limit is a ConfigError naming `key` (where it was given)."""
    if limit is None:
        return task
    if not limit > 0:
        raise ConfigError(f"{key}: {limit} is not a number of documents (1 or more) nor a share of them (below 1)")
    return dataclasses.replace(task, docs=task.docs[:math.ceil(len(task.docs) * limit) if limit < 1 else int(limit)])


def load_task(path: str, key: str = "--tasks") -> Task:
    """The task a file describes, with its documents read; DataError (one line, naming `key`: where the file was
    given) for anything unsupported."""
    if not os.path.isfile(path):
        raise DataError(f"{key}: no such task file '{path}'; give a YAML or JSON file in lm-evaluation-harness's "
                        "task format")
    spec = _load_file(path)
    where = f"task file {path}"
    if not isinstance(spec, dict):
        raise DataError(f"{where}: must be a mapping of task keys")
    unknown = sorted(set(spec) - KEYS)
    if unknown:
        raise DataError(f"{where}: keys {unknown} are not supported; supported: {', '.join(sorted(KEYS))}")
    kind = spec.get("output_type")
    if kind not in OUTPUT_TYPES:
        raise DataError(f"{where}: output_type {kind!r} is not one of {', '.join(OUTPUT_TYPES)}")
    needed = ["doc_to_target"] + {"multiple_choice": ["doc_to_text", "doc_to_choice"],
                                  "generate_until": ["doc_to_text"]}.get(kind, [])
    missing = [k for k in needed if k not in spec]
    if missing:
        raise DataError(f"{where}: {kind} needs {', '.join(missing)}")
    if spec.get("dataset_path") != "json":
        raise DataError(f"{where}: dataset_path must be json (local JSONL files in dataset_kwargs.data_files)")
    files = (spec.get("dataset_kwargs") or {}).get("data_files")
    if not isinstance(files, dict) or not files:
        raise DataError(f"{where}: dataset_kwargs.data_files must map split names to JSONL files")
    split = spec.get("test_split") or spec.get("validation_split")
    if split not in files:
        raise DataError(f"{where}: the evaluated split {split!r} (test_split) is not in data_files {sorted(files)}")
    fewshot = spec.get("fewshot_split")
    num_fewshot = int(spec.get("num_fewshot") or 0)
    if num_fewshot and fewshot not in files:
        raise DataError(f"{where}: num_fewshot={num_fewshot} needs fewshot_split naming one of {sorted(files)}")
    listed = [m if isinstance(m, dict) else {"metric": m} for m in spec.get("metric_list") or DEFAULT_METRICS[kind]]
    metrics = [m["metric"] for m in listed]
    bad = [m for m in metrics if m not in METRICS[kind]]
    if bad:
        raise DataError(f"{where}: metrics {bad} are not computed for {kind}; choose from {', '.join(METRICS[kind])}")
    args = {m["metric"]: {k: v for k, v in m.items() if k not in ("metric", "aggregation", "higher_is_better")}
            for m in listed}
    for metric, given in args.items():
        if set(given) - EXACT_MATCH_ARGS:
            raise DataError(f"{where}: {metric} does not take {sorted(set(given) - EXACT_MATCH_ARGS)}")
    delimiter = spec.get("fewshot_delimiter", "\n\n")
    read = lambda s: _read_jsonl(Path(path).parent / files[s], where)
    task = Task(name=spec.get("task") or Path(path).stem, output_type=kind, docs=read(split),
                fewshot_docs=read(fewshot) if num_fewshot else None, same_split=fewshot == split, spec=spec,
                num_fewshot=num_fewshot, description=spec.get("description", ""),
                target_delimiter=spec.get("target_delimiter", " "), fewshot_delimiter=delimiter, metrics=metrics,
                metric_args=args, **(_generation(spec, where, delimiter) if kind == "generate_until" else {}))
    return _rendered_once(task)


def _rendered_once(task: Task) -> Task:
    """The task, after its templates rendered on the first document of each split it reads: a misspelt column or a
    template that does not parse is one line here, before any model loads or run directory is written."""
    for doc in task.docs[:1] + (task.fewshot_docs or [])[:1]:
        for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
            if key in task.spec:
                task.render(key, doc)
    return task


def _generation(spec: dict, where: str, delimiter: str) -> dict:
    """until, max_gen_toks and the filters of a greedy generation task (lm-evaluation-harness's defaults)."""
    given = spec.get("generation_kwargs") or {}
    if set(given) - GENERATION_KEYS or given.get("do_sample") or given.get("temperature", 0) != 0:
        raise DataError(f"{where}: generation_kwargs must be greedy (do_sample false, temperature 0) with only "
                        f"{', '.join(sorted(GENERATION_KEYS))}; got {given}")
    until = given.get("until", [delimiter])
    filters = {"none": [{"function": "take_first"}]}
    if spec.get("filter_list"):
        filters = {f.get("name", "none"): f.get("filter", []) for f in spec["filter_list"]}
    for name, steps in filters.items():
        for step in steps:
            extra = set(step) - {"function"} - FILTERS.get(step.get("function"), set())
            if step.get("function") not in FILTERS or extra:
                raise DataError(f"{where}: filter {name!r}: {step} is not supported; filters are regex "
                                "(regex_pattern, group_select, fallback) and take_first")
    return {"until": [until] if isinstance(until, str) else list(until),
            "max_gen_toks": int(given.get("max_gen_toks", 256)), "filters": filters}
