"""Benchmark evaluation (`jaxllm eval`) against lm-evaluation-harness 0.4 itself, on the same task files.

A tiny random transformers LLaMA with the LLaMA-3-style tokenizer fixture (BOS added) and one with the GPT-2-style
fixture (no BOS): lm-evaluation-harness's Hugging Face backend (HFLM, fp32, max_length = jaxllm's model.seq_len)
and `jaxllm eval` (fp32, on the test process's 8 devices) read the same YAML files over the same JSONL data. First
the rendered requests (strings) must be equal, then each request's log-likelihood within 1e-4, then every
metric. Tasks: ARC-, HellaSwag-, PIQA- and MMLU-style multiple choice with few-shot examples (from another split,
and from the evaluated split itself), one with non-ASCII choices, and a rolling log-likelihood task whose
documents span several windows.
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

import hf_families as H
from harness import subprocess_env

FIXTURES = Path(__file__).parent / "fixtures"
SEQ = 48
rng = np.random.default_rng(0)
WORDS = "the cat dog sat on a mat ran far away big small red blue green tree house water fire".split()


def _sentence(n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n)).capitalize()


def _docs() -> dict[str, list[dict]]:
    arc = [{"question": _sentence(6) + "?", "choices": {"text": [_sentence(2) for _ in range(4)],
                                                       "label": ["A", "B", "C", "D"]}, "answerKey": "ABCD"[i % 4]}
           for i in range(10)]
    swag = [{"ctx": _sentence(8), "endings": [_sentence(3) for _ in range(4)], "label": str(i % 4)} for i in range(8)]
    piqa = [{"goal": _sentence(5), "sol1": "café crème ✓ " + _sentence(2), "sol2": "数据 " + _sentence(3),
             "label": i % 2} for i in range(8)]
    mmlu = [{"question": _sentence(7), "choices": [_sentence(1) for _ in range(4)], "answer": i % 4}
            for i in range(9)]
    wiki = [{"page": " ".join(_sentence(12) + "." for _ in range(4))} for _ in range(5)]
    gsm = [{"question": f"{_sentence(4)} {a} and {b}?", "answer": f"{_sentence(3)} {a}+{b}={a + b}.\n#### {a + b}"}
           for a, b in rng.integers(1, 99, size=(9, 2)).tolist()]
    return {"arc": arc, "swag": swag, "piqa": piqa, "mmlu": mmlu, "wiki": wiki, "gsm": gsm}


TASKS = {  # name -> (task keys besides the data, splits: name -> docs slice)
    "arc_like": ({"output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
                  "doc_to_target": "{{choices.label.index(answerKey)}}", "doc_to_choice": "{{choices.text}}",
                  "num_fewshot": 2, "fewshot_split": "train", "test_split": "test",
                  "metric_list": [{"metric": m} for m in ("acc", "acc_norm", "acc_bytes")]},
                 ("arc", {"train": slice(0, 4), "test": slice(4, 10)})),
    "hellaswag_like": ({"output_type": "multiple_choice", "doc_to_text": "{{ctx}}", "doc_to_target": "{{label}}",
                        "doc_to_choice": "endings", "num_fewshot": 1, "fewshot_split": "validation",
                        "test_split": "validation", "description": "Finish the sentence.\n\n"},
                       ("swag", {"validation": slice(0, 8)})),
    "piqa_like": ({"output_type": "multiple_choice", "doc_to_text": "Question: {{goal}}\nAnswer: ",  # the space moves
                   "doc_to_target": "label", "doc_to_choice": "{{[sol1, sol2]}}", "test_split": "test",
                   "metric_list": [{"metric": m} for m in ("acc", "acc_norm", "acc_bytes")]},
                  ("piqa", {"test": slice(0, 8)})),
    "mmlu_like": ({"output_type": "multiple_choice", "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\n"
                   "B. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:", "doc_to_target": "answer",
                   "doc_to_choice": ["A", "B", "C", "D"], "num_fewshot": 3, "fewshot_split": "dev",
                   "test_split": "test", "target_delimiter": " ", "fewshot_delimiter": "\n\n"},
                  ("mmlu", {"dev": slice(0, 4), "test": slice(4, 9)})),
    "wiki_like": ({"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "page",
                   "test_split": "test"}, ("wiki", {"test": slice(0, 5)})),
    "gsm8k_like": ({"output_type": "generate_until", "doc_to_text": "Question: {{question}}\nAnswer:",
                    "doc_to_target": "{{answer}}", "num_fewshot": 2, "fewshot_split": "train", "test_split": "test",
                    "generation_kwargs": {"until": ["Question:", "</s>", "\n\n"], "do_sample": False,
                                          "temperature": 0.0, "max_gen_toks": 12},
                    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                                     "ignore_case": True, "ignore_punctuation": False,
                                     "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"]}],
                    "filter_list": [{"name": "strict-match", "filter": [{"function": "regex",
                                                                          "regex_pattern": "#### (\\-?[0-9\\.\\,]+)"},
                                                                         {"function": "take_first"}]},
                                    {"name": "flexible-extract", "filter": [
                                        {"function": "regex", "group_select": -1,
                                         "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
                                        {"function": "take_first"}]}]},
                   ("gsm", {"train": slice(0, 4), "test": slice(4, 9)})),
}
GENERATION = {"gsm8k_like"}


def write_tasks(folder: Path) -> list[Path]:
    """The task files (absolute data paths, so that lm-evaluation-harness reads them too) and their data."""
    docs, paths = _docs(), []
    for name, (keys, (source, splits)) in TASKS.items():
        files = {}
        for split, part in splits.items():
            files[split] = str(folder / f"{name}_{split}.jsonl")
            Path(files[split]).write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs[source][part]))
        spec = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": files}, **keys}
        paths.append(folder / f"{name}.yaml")
        paths[-1].write_text(json.dumps(spec, ensure_ascii=False, indent=1))  # JSON is YAML
    return paths


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
    tasks = root / "tasks"
    tasks.mkdir()
    return models, write_tasks(tasks)


def lm_eval_run(model_dir: str, task_files: list[Path]) -> dict:
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"
    os.environ["HF_UPDATE_DOWNLOAD_COUNTS"] = "0"
    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, max_length=SEQ, batch_size=4)
    manager = TaskManager(include_path=str(task_files[0].parent), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=[p.stem for p in task_files], task_manager=manager,
                                   log_samples=True, bootstrap_iters=0)


def ours_run(model_dir: str, task_files: list[Path], out: Path, *over: str) -> dict:
    from jaxllm.cli import eval as eval_cli

    assert eval_cli.main(["--from", f"hf:{model_dir}", "--tasks", *map(str, task_files), "--out", str(out),
                          "precision.compute=float32", f"model.seq_len={SEQ}", "train.global_batch=8", *over]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow  # lm-evaluation-harness and torch on each task
@pytest.mark.parametrize("model", ["llama3", "gpt2style"])
def test_requests_loglikelihoods_and_metrics_equal_lm_evaluation_harness(setup, model, tmp_path):
    models, task_files = setup
    theirs = lm_eval_run(models[model], task_files)
    ours = ours_run(models[model], task_files, tmp_path / "ours.json")
    for name in GENERATION:  # one sample per document and filter: the generated text, and each filter's answer
        samples = sorted(theirs["samples"][name], key=lambda s: (s["doc_id"], s["filter"]))
        assert len(samples) == 2 * len(ours["samples"][name])
        for s in samples:
            o = ours["samples"][name][s["doc_id"]]
            assert s["arguments"][0][0] == o["arguments"][0][0]  # the context
            assert (s["resps"][0][0], s["filtered_resps"][0]) == (o["generated"], o[f"filtered/{s['filter']}"])
        for key, value in ours["results"][name].items():
            assert value == theirs["results"][name][key.replace("/", ",")], (name, key)
    for name in set(TASKS) - GENERATION:
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


_one: dict = {}


def one_device(setup, tmp_path) -> dict:
    """`jaxllm eval` on one device (a process of its own), once for the file."""
    if "out" not in _one:
        models, task_files = setup
        out = tmp_path / "one.json"
        done = subprocess.run([sys.executable, "-m", "jaxllm", "eval", "--from", f"hf:{models['llama3']}", "--tasks",
                               *map(str, task_files), "--out", str(out), "precision.compute=float32",
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
    spread = ours_run(models["llama3"], task_files, tmp_path / "mesh.json", *mesh)
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
    from jaxllm.train.loop import train

    (tmp_path / "tasks").mkdir()
    task_files = write_tasks(tmp_path / "tasks")
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
                                                        if TASKS[n][0]["output_type"] == "multiple_choice")
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

    steps = TASKS["gsm8k_like"][0]["filter_list"]
    for f in steps:
        regex = {k: v for k, v in f["filter"][0].items() if k != "function"}
        theirs = [r[0] for r in RegexFilter(**regex).apply([[t] for t in FILTER_TEXTS], None)]
        assert [metrics.apply_filter(f["filter"], t) for t in FILTER_TEXTS] == theirs, f["name"]
    options = [{}, {"ignore_case": True}, {"ignore_punctuation": True, "ignore_numbers": True},
               TASKS["gsm8k_like"][0]["metric_list"][0] | {"metric": None}]
    for option in options:
        option = {k: v for k, v in option.items() if k not in ("metric", "aggregation", "higher_is_better")}
        for pred in FILTER_TEXTS:
            for gold in ("42", "#### 42", "The Answer is 42.", pred.upper(), "3"):
                want = exact_match_hf_evaluate([pred], [gold], **option)["exact_match"]
                assert metrics.exact_match(pred, gold, **option) == want, (pred, gold, option)
