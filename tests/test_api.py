"""The Python API (jaxllm/api.py): docs/api.md's code blocks run as written, in order, on one tiny run; the
command's subcommands compute what the API computes (generate token for token, eval number for number, export
byte for byte); and the library sits under the command: the import rules, and each `jaxllm/cli` module only
parses, prints and calls the library."""

from __future__ import annotations

import ast
import json
import os
import re

import chex
import pytest

from harness import REPO

PAGE = REPO / "docs" / "api.md"


def blocks(text: str) -> list[str]:
    """The page's python code blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """docs/api.md's blocks run in one namespace, in a fresh folder (they train the tiny run they use)."""
    where, namespace = tmp_path_factory.mktemp("api_page"), {}
    before = os.getcwd()
    os.chdir(where)
    try:
        for block in blocks(PAGE.read_text()):
            exec(compile(block, str(PAGE), "exec"), namespace)
    finally:
        os.chdir(before)
    namespace["where"] = where
    return namespace


def test_the_pages_blocks_run_and_say_what_the_page_says(page):
    assert len(blocks(PAGE.read_text())) == 6
    result, model = page["result"], page["model"]
    first = json.loads((page["where"] / "runs" / "api" / "metrics.jsonl").read_text().splitlines()[0])
    assert result.final_step == 80 and result.last_row["step"] == 80 and result.last_row["loss"] < first["loss"] - 1
    assert result.run_dir == "runs/api" and (page["where"] / "runs" / "api" / "checkpoints" / "80").is_dir()
    gens = model.generate(["def ", "import "], max_new_tokens=12, temperature=0)
    assert [g.text[:4] for g in gens] == ["def ", "impo"] and all(len(g.tokens) <= 12 for g in gens)
    assert page["good"] > page["bad"]  # a run of 80 steps on Python source prefers `import os`
    chex.assert_shape(page["row"], (9, model.cfg.model.vocab_size))
    assert set(page["evaluation"].results) == {"imports"} and len(page["evaluation"].samples["imports"]) == 2
    assert {"config.json", "model.safetensors"} <= set(os.listdir(page["where"] / "runs" / "api-hf"))


def test_score_is_the_sum_of_the_logits_log_probabilities(page):
    """`score` against `logits`: the continuation's tokens' log-softmax, summed (the two paths share no code past
    the trainer's forward pass: token_logp's masked sum against the full logits)."""
    import numpy as np

    from jaxllm.eval.requests import encode_pair

    model = page["model"]
    context, continuation = encode_pair(model.tokenizer, "import ", "os")
    [row] = model.logits([context + continuation])
    logp = row - np.logaddexp.reduce(row.astype(np.float64), axis=-1, keepdims=True)
    want = sum(logp[len(context) - 1 + i, t] for i, t in enumerate(continuation))
    assert page["good"] == pytest.approx(want, abs=1e-5)


def test_a_run_loads_where_its_training_data_is_not(page, tmp_path):
    """A run directory moved away from its data (config.toml's data.source a path that is not there, as a relative
    path is from another folder): loading it to generate, score or export reads no training data, so it loads, with
    the same logits."""
    import shutil

    import jaxllm

    run = tmp_path / "moved"
    shutil.copytree(page["where"] / "runs" / "api", run)
    config = (run / "config.toml").read_text()
    assert f'source = "{os.__file__}"' in config
    (run / "config.toml").write_text(config.replace(f'source = "{os.__file__}"', 'source = "gone/train.jsonl"'))
    moved = jaxllm.load(str(run))
    chex.assert_trees_all_equal(moved.logits(["import os"]), page["model"].logits(["import os"]))


def test_generate_is_the_commands_token_for_token(page, capsys):
    from jaxllm.cli import generate as command

    run = str(page["where"] / "runs" / "api")
    capsys.readouterr()
    assert command.main(["--from", run, "--prompt", "def ", "--prompt", "import ", "--max-new-tokens", "12",
                         "--temperature", "0.8", "--seed", "3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    gens = page["model"].generate(["def ", "import "], max_new_tokens=12, temperature=0.8, seed=3)
    assert printed == [g.text for g in gens] and len(printed) == 2


@pytest.mark.slow
def test_a_file_of_prompts_generates_on_the_rollout_engine_as_one_batch_does(page, capsys, tmp_path):
    """`jaxllm generate --prompts FILE`: one JSON line per prompt, in the file's order, with the tokens the static
    engine samples for the same prompts in one batch (the engine draws request i as row i), each cut at its line's
    own max_new_tokens (`--max-new-tokens` where the line names none): as `Model.generate` cuts them. With
    `--pages 4` (a request's 3 pages and scratch) each request waits for the one before it."""
    import json

    from jaxllm.cli import generate as command

    prompts, limits = ["def ", "import os", "class A:", "def "], [12, 5, 3, 12]
    lines = [{"prompt": "def "}, {"prompt": "import os", "max_new_tokens": 5}, {"prompt": "class A:",
                                                                               "max_new_tokens": 3}]
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)) + '\n"def "\n')
    capsys.readouterr()
    assert command.main(["--from", str(page["where"] / "runs" / "api"), "--prompts", str(tmp_path / "p.jsonl"),
                         "--slots", "2", "--pages", "4", "--max-new-tokens", "12", "--temperature", "0.8",
                         "--seed", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    whole = page["model"].generate(prompts, max_new_tokens=12, temperature=0.8, seed=3)
    assert all(len(g.tokens) > n for g, n in zip(whole[1:3], limits[1:3]))  # the lines' limits cut something
    assert [r["prompt"] for r in rows] == prompts
    assert [r["tokens"] for r in rows] == [g.tokens[:n].tolist() for g, n in zip(whole, limits)]
    each = page["model"].generate(prompts, max_new_tokens=limits, temperature=0.8, seed=3)
    assert [(r["tokens"], r["text"], r["stopped"]) for r in rows] == [(g.tokens.tolist(), g.text, g.stopped)
                                                                      for g in each]


@pytest.mark.slow
def test_chat_questions_from_a_file_are_answered_as_the_api_answers_them(page, capsys, tmp_path):
    """`jaxllm generate --chat --prompts FILE`: each question through the chat template (the byte tokenizer's
    built-in one), on the rollout engine, one JSON line {prompt, answer} each: `Model.chat`'s answers, sampled."""
    from jaxllm.cli import generate as command

    questions = ["def ", "import os", "class A:"]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    capsys.readouterr()
    assert command.main(["--from", str(page["where"] / "runs" / "api"), "--chat", "--prompts", str(tmp_path / "q.jsonl"),
                         "--slots", "2", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    answers = page["model"].chat(questions, 12, temperature=0.8, seed=3)
    assert rows == [{"prompt": q, "answer": a} for q, a in zip(questions, answers)]
    assert any(answers)  # sampled from a byte model: not all of them end at once


def test_evaluate_is_the_commands_number_for_number(page, capsys):
    from jaxllm.cli import eval as command

    where = page["where"]
    assert command.main(["--from", str(where / "runs" / "api"), "--tasks", str(where / "tasks" / "imports.yaml"),
                         "--out", str(where / "eval.json")]) == 0
    written = json.loads((where / "eval.json").read_text())
    assert written["results"] == page["evaluation"].results
    assert written["samples"] == json.loads(json.dumps(page["evaluation"].samples))


def test_export_is_the_commands_byte_for_byte(page):
    from jaxllm.cli import hf as command

    where = page["where"]
    assert command.main(["export", str(where / "runs" / "api"), str(where / "by-command"), "--dtype", "float32"]) == 0
    names = sorted(os.listdir(where / "runs" / "api-hf"))
    assert names == sorted(os.listdir(where / "by-command"))
    for name in names:
        assert (where / "runs" / "api-hf" / name).read_bytes() == (where / "by-command" / name).read_bytes(), name


# ---------------------------------------------------------------- the library under the command

def imports(path) -> list[tuple[str, list[str]]]:
    """(module, names) of each import in a Python file: `import a.b` is ("a.b", []), `from a import b, c`
    ("a", ["b", "c"])."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
    return found


def reaches_cli(module: str, names: list[str]) -> bool:
    return module == "jaxllm.cli" or module.startswith("jaxllm.cli.") or (module == "jaxllm" and "cli" in names)


def test_nothing_but_the_entry_points_imports_the_command():
    """Nothing under jaxllm/ but the command itself and `python -m jaxllm`, and nothing under tools/, imports
    jaxllm.cli; nothing under jaxllm/ imports tools/."""
    for path in sorted((REPO / "jaxllm").rglob("*.py")) + sorted((REPO / "tools").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("jaxllm/cli/") or rel == "jaxllm/__main__.py":
            continue
        found = imports(path)
        assert not [m for m, names in found if reaches_cli(m, names)], rel
        if rel.startswith("jaxllm/"):
            assert not [m for m, _ in found if m == "tools" or m.startswith("tools.")], rel


def test_tests_import_the_command_only_to_run_it():
    """A test imports a `jaxllm.cli` module (to call its `main`) or the subcommand table, never a command's
    helpers: what a test needs of the library it takes from the library."""
    allowed = {"main", "COMMANDS", "parser"} | {p.stem for p in (REPO / "jaxllm" / "cli").glob("*.py")}
    for path in sorted((REPO / "tests").glob("*.py")):
        for module, names in imports(path):
            if module != "jaxllm" and reaches_cli(module, names):  # `from jaxllm import cli`: the command's package
                assert set(names) <= allowed, (path.name, module, names)


def test_each_command_module_only_parses_prints_and_calls_the_library():
    """Each jaxllm/cli module defines functions only (cli/__init__: the one-line ArgumentParser too), none past
    40 lines; it imports no other command module's internals (the package's shared helpers are fine), and what it
    calls of jaxllm is the library's."""
    for path in sorted((REPO / "jaxllm" / "cli").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                assert path.name == "__init__.py" and node.name == "ArgumentParser", (path.name, node.name)
            elif isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno < 40, (path.name, node.name)
        assert not [m for m, _ in imports(path) if m.startswith("jaxllm.cli.")], path.name
