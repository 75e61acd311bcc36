"""Benchmark evaluation (`jaxllm eval`) against lm-evaluation-harness 0.4 itself, on the same task files.

A tiny random transformers LLaMA with the LLaMA-3-style tokenizer fixture (BOS added) and one with the GPT-2-style
fixture (no BOS): lm-evaluation-harness's Hugging Face backend (HFLM, fp32, max_length = jaxllm's model.seq_len)
and `jaxllm eval` (fp32, on the test process's 8 devices) read the same YAML files over the same JSONL data. First
the rendered requests (strings) must be equal, then each request's log-likelihood within 1e-4, then every
metric. Tasks (tests/fixtures/eval): ARC-, HellaSwag-, PIQA- and MMLU-style multiple choice with few-shot
examples (from another split, and from the evaluated split itself), one with non-ASCII choices, a rolling
log-likelihood task whose documents span several windows, and GSM8K-style generation with two filters. Also: a
trained run against lm-evaluation-harness on its export; meshes against one device; the tasks during training;
the filters and exact match against lm-evaluation-harness's functions; bad task files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import hf_families as H
from harness import subprocess_env

FIXTURES = Path(__file__).parent / "fixtures"
SEQ = 48
# Task files in the layouts of ARC, HellaSwag (few-shot from the evaluated split), PIQA (non-ASCII choices, a context
# ending in a space), MMLU, WikiText (rolling log-likelihood over several windows) and GSM8K (generation, two
# filters), a few documents each of random words, relative data paths (as jaxllm reads them)
TASK_FILES = sorted((FIXTURES / "eval").glob("*.yaml"))
SPECS = {p.stem: yaml.safe_load(p.read_text()) for p in TASK_FILES}
TASKS = list(SPECS)
GENERATION = {name for name, spec in SPECS.items() if spec["output_type"] == "generate_until"}


def absolute_copies(folder: Path, task_files: list[Path] = TASK_FILES) -> list[Path]:
    """The task files with absolute data paths, as lm-evaluation-harness needs them."""
    out = []
    for path in task_files:
        spec = yaml.safe_load(path.read_text())
        files = spec["dataset_kwargs"]["data_files"]
        spec["dataset_kwargs"]["data_files"] = {k: str(path.parent / v) for k, v in files.items()}
        out.append(folder / path.name)
        out[-1].write_text(yaml.safe_dump(spec, allow_unicode=True))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchmarks")
    models = {}
    for name, tokenizer in (("llama3", "hf_tokenizer"), ("gpt2style", "hf_tokenizer_gpt2")):
        vocab = json.loads((FIXTURES / tokenizer / "tokenizer.json").read_text())
        size = 1 + max([*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab["added_tokens"])])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(H, "WEIGHT_STD", 0.02)
            models[name] = H.build("llama3", str(root / name), vocab_size=size, max_position_embeddings=SEQ)
        for f in (FIXTURES / tokenizer).iterdir():
            shutil.copy(f, root / name / f.name)
    (root / "tasks").mkdir()
    return models, absolute_copies(root / "tasks")


def lm_eval_run(model_dir: str, task_files: list[Path], **options) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return lm_eval_with(model, transformers.AutoTokenizer.from_pretrained(model_dir), task_files, SEQ, **options)


def lm_eval_with(model, tokenizer, task_files: list[Path], max_length: int, **options) -> dict:
    """lm-evaluation-harness's Hugging Face backend on a transformers model and tokenizer, over `task_files`."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"
    os.environ["HF_UPDATE_DOWNLOAD_COUNTS"] = "0"
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=4)
    manager = TaskManager(include_path=str(task_files[0].parent), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=[p.stem for p in task_files], task_manager=manager,
                                   log_samples=True, bootstrap_iters=0, **options)


def ours_run(model_dir: str, task_files: list[Path], out: Path, *over: str, source: str | None = None) -> dict:
    from jaxllm.cli import eval as eval_cli

    assert eval_cli.main(["--from", source or f"hf:{model_dir}", "--tasks", *map(str, task_files), "--out", str(out),
                          "precision.compute=float32", f"model.seq_len={SEQ}", "train.global_batch=8", *over]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow  # lm-evaluation-harness and torch on each task
@pytest.mark.parametrize("model", ["llama3", "gpt2style"])
def test_requests_loglikelihoods_and_metrics_equal_lm_evaluation_harness(setup, model, tmp_path):
    models, task_files = setup
    assert_same(lm_eval_run(models[model], task_files), ours_run(models[model], TASK_FILES, tmp_path / "ours.json"))


@pytest.mark.slow
@pytest.mark.parametrize("multiturn", [True, False], ids=["multiturn", "single_turn"])
def test_through_the_chat_template_as_lm_evaluation_harness(setup, multiturn, tmp_path):
    """The LLaMA-3-style tokenizer's chat template (tokenizer_config.json): few-shot examples as turns or as one
    user message, the description as the system message, the choice after the generation prompt."""
    models, task_files = setup
    names = ["arc_like", "hellaswag_like", "gsm8k_like"]  # few-shot from another split and its own; a description;
    theirs = lm_eval_run(models["llama3"], [p for p in task_files if p.stem in names],  # generation
                         apply_chat_template=True, fewshot_as_multiturn=multiturn)
    ours = ours_run(models["llama3"], [p for p in TASK_FILES if p.stem in names], tmp_path / "ours.json",
                    "--apply-chat-template", "--fewshot-as-multiturn" if multiturn else "--no-fewshot-as-multiturn")
    assert "<|start_header_id|>user<|end_header_id|>" in ours["samples"]["arc_like"][0]["arguments"][0][0]
    assert_same(theirs, ours, names)


@pytest.mark.slow
def test_a_limit_takes_each_tasks_first_documents_as_lm_evaluation_harness(setup, tmp_path):
    """`--limit 0.5`: half of each task's documents, rounded up, the first ones, with the few-shot examples
    lm-evaluation-harness's `limit` gives them (drawn from the whole split, the evaluated split's own included)."""
    models, task_files = setup
    names = ["arc_like", "hellaswag_like", "gsm8k_like"]
    theirs = lm_eval_run(models["llama3"], [p for p in task_files if p.stem in names], limit=0.5)
    ours = ours_run(models["llama3"], [p for p in TASK_FILES if p.stem in names], tmp_path / "ours.json", "--limit=0.5")
    assert_same(theirs, ours, names=names)
    for name in names:
        docs = sum(1 for line in open(FIXTURES / "eval" / SPECS[name]["dataset_kwargs"]["data_files"][
            SPECS[name]["test_split"]]) if line.strip())
        assert len(ours["samples"][name]) == -(-docs // 2) < docs, name


def assert_same(theirs: dict, ours: dict, names=tuple(TASKS)) -> None:
    """lm-evaluation-harness's results and samples against jaxllm eval's: requests, then scores, then metrics."""
    for name in GENERATION & set(names):  # one sample per document and filter: the generated text, and each filter's answer
        samples = sorted(theirs["samples"][name], key=lambda s: (s["doc_id"], s["filter"]))
        assert len(samples) == 2 * len(ours["samples"][name])
        for s in samples:
            o = ours["samples"][name][s["doc_id"]]
            assert s["arguments"][0][0] == o["arguments"][0][0]  # the context
            assert (s["resps"][0][0], s["filtered_resps"][0]) == (o["generated"], o[f"filtered/{s['filter']}"])
        for key, value in ours["results"][name].items():
            assert value == theirs["results"][name][key.replace("/", ",")], (name, key)
    for name in set(names) - GENERATION:
        samples = sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
        assert len(samples) == len(ours["samples"][name])
        for s, o in zip(samples, ours["samples"][name]):  # the requests first, as strings
            assert [list(a[:2]) if len(a) > 1 else list(a) for a in s["arguments"]] == o["arguments"], name
        for s, o in zip(samples, ours["samples"][name]):
            want = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in s["resps"]]
            np.testing.assert_allclose(o["loglikelihoods"], want, atol=1e-4, rtol=0, err_msg=name)
        for metric, value in ours["results"][name].items():  # accuracies exactly; the rest within what the
            exact = metric.startswith("acc")  # log-likelihoods' 1e-4 allows (perplexity: exp of their mean per word)
            want = theirs["results"][name][f"{metric},none"]
            assert value == want if exact else value == pytest.approx(want, rel=1e-5), (name, metric, value, want)


@pytest.mark.slow
def test_a_trained_run_scores_as_lm_evaluation_harness_scores_its_export(tmp_path):
    """Train a few steps (the LLaMA-3-style tokenizer, the WikiText fixture as data), export the run to transformers,
    then lm-evaluation-harness on the export and `jaxllm eval` on the run must agree."""
    from jaxllm.cli import hf as hf_cli
    from jaxllm.config import build_config
    from jaxllm.trainer.loop import train

    run = tmp_path / "run"
    train(build_config(None, {"model.preset": "tiny-llama", "data.tokenizer": f"hf:{FIXTURES / 'hf_tokenizer'}",
                              "data.source": str(FIXTURES / "eval" / "wiki_like_test.jsonl"), "data.text_key": "page",
                              "data.val_percent": 0, "model.seq_len": SEQ, "train.steps": 3, "train.global_batch": 8,
                              "train.checkpoint_every": 3, "train.eval_every": 0, "run.sample_tokens": 0,
                              "run.progress": False, "precision.compute": "float32", "run.dir": str(run)}))
    assert hf_cli.main(["export", str(run), str(tmp_path / "exported"), "--dtype", "float32"]) == 0
    (tmp_path / "tasks").mkdir()
    theirs = lm_eval_run(str(tmp_path / "exported"), absolute_copies(tmp_path / "tasks"))
    assert_same(theirs, ours_run(str(run), TASK_FILES, tmp_path / "ours.json", source=str(run)))


_one: dict = {}


def one_device(setup, tmp_path) -> dict:
    """`jaxllm eval` on one device (a process of its own), once for the file."""
    if "out" not in _one:
        models, _ = setup
        out = tmp_path / "one.json"
        done = subprocess.run([sys.executable, "-m", "jaxllm", "eval", "--from", f"hf:{models['llama3']}", "--tasks",
                               *map(str, TASK_FILES), "--out", str(out), "precision.compute=float32",
                               f"model.seq_len={SEQ}", "train.global_batch=8"], env=subprocess_env(1),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        _one["out"] = json.loads(out.read_text())
    return _one["out"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.zero_stage=3"],
    ["mesh.pp=2", "mesh.dp=4", "train.microbatches=2"],
], ids=["dp2_fsdp2_tp2_zero3", "pp2_dp4"])
def test_every_mesh_scores_as_one_device(setup, mesh, tmp_path):
    models, task_files = setup
    spread = ours_run(models["llama3"], TASK_FILES, tmp_path / "mesh.json", *mesh)
    base = one_device(setup, tmp_path)
    for name in set(TASKS) - GENERATION:
        for a, b in zip(base["samples"][name], spread["samples"][name]):
            np.testing.assert_allclose(b["loglikelihoods"], a["loglikelihoods"], rtol=1e-5, atol=1e-5, err_msg=name)
    for name in GENERATION:
        assert [o["generated"] for o in spread["samples"][name]] == [o["generated"] for o in base["samples"][name]]
    for name in TASKS:
        for metric, value in base["results"][name].items():
            got = spread["results"][name][metric]
            assert got == value if metric.startswith("acc") else got == pytest.approx(value, rel=1e-5), (name, metric)


def _task(folder: Path, **keys) -> Path:
    (folder / "d.jsonl").write_text('{"q": "one", "a": ["x", "y"], "g": 0}\n')
    spec = {"task": "t", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "d.jsonl"}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_target": "g",
            "doc_to_choice": "a", **keys}
    path = folder / "t.yaml"
    path.write_text(json.dumps({k: v for k, v in spec.items() if v is not None}))
    return path


BAD_TASKS = {  # name -> (task keys, words the one line must hold)
    "output_type": ({"output_type": "loglikelihood"}, "output_type 'loglikelihood' is not one of"),
    "sampling": ({"output_type": "generate_until", "generation_kwargs": {"do_sample": True}}, "must be greedy"),
    "filter": ({"output_type": "generate_until", "filter_list": [{"name": "f", "filter": [{"function": "lowercase"}]}]},
               "filter 'f'"),
    "unknown_key": ({"process_results": "x"}, "keys ['process_results'] are not supported"),
    "no_choices": ({"doc_to_choice": None}, "multiple_choice needs doc_to_choice"),
    "missing_data": ({"dataset_kwargs": {"data_files": {"test": "nowhere.jsonl"}}}, "no such data file"),
    "metric": ({"metric_list": [{"metric": "exact_match"}]}, "metrics ['exact_match'] are not computed"),
    "remote": ({"dataset_path": "allenai/ai2_arc"}, "dataset_path must be json"),
    "misspelt_column": ({"doc_to_text": "{{qq}}"}, "task t: doc_to_text '{{qq}}' on a document of columns "
                                                   "['a', 'g', 'q']: UndefinedError: 'qq' is undefined"),
    "template_syntax": ({"doc_to_text": "{{q}"}, "doc_to_text '{{q}' on a document of columns ['a', 'g', 'q']: "
                                                 "TemplateSyntaxError"),
}


@pytest.mark.parametrize("case", BAD_TASKS)
def test_bad_task_files_are_one_line_exit_2(case, tmp_path, capsys):
    from jaxllm.cli import eval as eval_cli

    keys, words = BAD_TASKS[case]
    path = _task(tmp_path, **keys)
    assert eval_cli.main(["--from", "hf:nowhere", "--tasks", str(path)]) == 2  # refused before any model loads
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines


@pytest.mark.slow
def test_benchmarks_during_training_leave_the_losses_bitwise_and_equal_jaxllm_eval(tmp_path):
    from jaxllm.cli import eval as eval_cli
    from jaxllm.config import build_config
    from jaxllm.trainer.loop import train

    task_files = TASK_FILES
    rows = {}
    for name, tasks in (("plain", []), ("with", [str(p) for p in task_files])):
        train(build_config(None, {"model.preset": "tiny-gpt2", "train.steps": 4, "train.eval_every": 2,
                                  "train.checkpoint_every": 2, "train.log_every": 1, "train.global_batch": 8,
                                  "train.eval_tasks": tasks, "run.sample_tokens": 0, "run.progress": False,
                                  "precision.compute": "float32", "run.dir": str(tmp_path / name)}))
        rows[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    losses = lambda rs: [(r["step"], r["loss"], r["grad_norm"]) for r in rs if "loss" in r]
    assert losses(rows["with"]) == losses(rows["plain"])  # scoring benchmarks changes no training bit
    scored = [r for r in rows["with"] if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in scored] == [2, 4] and all(f"eval/{n}/acc" in scored[0] for n in TASKS
                                                        if SPECS[n]["output_type"] == "multiple_choice")
    saved = json.loads((tmp_path / "with" / "eval" / "step_2.json").read_text())
    assert {f"eval/{n}/{m}": v for n, ms in saved["results"].items() for m, v in ms.items()} == \
        {k: v for k, v in scored[0].items() if k != "step"}
    out = tmp_path / "again.json"  # the checkpoint of step 2 scored alone: the same numbers
    assert eval_cli.main(["--from", str(tmp_path / "with"), "--step", "2", "--tasks", *map(str, task_files),
                          "--out", str(out), "precision.compute=float32"]) == 0
    again = json.loads(out.read_text())
    for name in set(TASKS) - GENERATION:
        np.testing.assert_allclose([ll for s in again["samples"][name] for ll in s["loglikelihoods"]],
                                   [ll for s in saved["samples"][name] for ll in s["loglikelihoods"]], rtol=1e-6)
    for name in GENERATION:
        assert [s["generated"] for s in again["samples"][name]] == [s["generated"] for s in saved["samples"][name]]


FILTER_TEXTS = ["The answer is 42.\n#### 42", "#### -1,234.5 then #### 7", "costs $12 or 13", "no number", "",
                "Ünïcödé 3.14 ✓ #### 3", "1,000,000 and 2"]


def test_filters_and_exact_match_equal_lm_evaluation_harness():
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    from jaxllm.eval import metrics

    steps = SPECS["gsm8k_like"]["filter_list"]
    for f in steps:
        regex = {k: v for k, v in f["filter"][0].items() if k != "function"}
        theirs = [r[0] for r in RegexFilter(**regex).apply([[t] for t in FILTER_TEXTS], None)]
        assert [metrics.apply_filter(f["filter"], t) for t in FILTER_TEXTS] == theirs, f["name"]
    options = [{}, {"ignore_case": True}, {"ignore_punctuation": True, "ignore_numbers": True},
               SPECS["gsm8k_like"]["metric_list"][0] | {"metric": None}]
    for option in options:
        option = {k: v for k, v in option.items() if k not in ("metric", "aggregation", "higher_is_better")}
        for pred in FILTER_TEXTS:
            for gold in ("42", "#### 42", "The Answer is 42.", pred.upper(), "3"):
                want = exact_match_hf_evaluate([pred], [gold], **option)["exact_match"]
                assert metrics.exact_match(pred, gold, **option) == want, (pred, gold, option)
