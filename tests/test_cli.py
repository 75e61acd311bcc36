"""The `jaxllm` command: every subcommand on one line of its help, a bad command line as one line on
stderr and exit code 2, the shipped configs by name, and a wheel that carries the jaxllm package (its
configs and the `jaxllm` script) and neither tools/ nor experiments/, which work from a checkout only."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile

import pytest

from harness import REPO
from jaxllm import cli, config
from jaxllm.cli.main import COMMANDS, main
from jaxllm.errors import ConfigError


def _call(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `jaxllm ARGV` run in this process."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_shows_each_subcommand_on_one_line(capsys):
    code, out, _ = _call(["--help"], capsys)
    assert code == 0
    lines = [line.split(None, 1) for line in out.splitlines()]
    for name, (_, help_line) in COMMANDS.items():
        assert [name, help_line] in lines, f"{name}: its help is not one line of\n{out}"


def test_python_dash_m_jaxllm_is_the_command():
    done = subprocess.run([sys.executable, "-m", "jaxllm", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: jaxllm ") and "prepare-data" in done.stdout


@pytest.mark.parametrize("argv", [[name] for name in COMMANDS] + [["hf", "import"], ["hf", "export"]])
def test_every_subcommand_has_help(argv, capsys):
    code, out, _ = _call([*argv, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: jaxllm {' '.join(argv)} ")


@pytest.mark.parametrize("argv, says", [
    (["trian"], "invalid choice: 'trian'"),
    ([], "give a subcommand"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["plan", "--bogus"], "jaxllm plan: error: unrecognized arguments: --bogus"),
    (["generate", "--from", "runs/x", "--prompt", "hi", "--bogus"], "jaxllm generate: error: unrecognized"),
    (["hf", "import", "only_one"], "jaxllm hf import: error: the following arguments are required: run_dir"),
    (["prepare-data", "in", "out", "--shard-tokens", "0"], "must be at least 1, got 0"),
    (["prepare-data", "in", "out", "--tokenizer", "bpe"], "--tokenizer: unknown tokenizer 'bpe'; choose one of byte"),
    (["prepare-data", "in", "out", "--tokenizer", "hf:no/such"], "--tokenizer=hf:no/such: no such folder 'no/such'"),
    (["generate", "--from", "runs/x", "--prompts", "p.jsonl", "--slots", "0"], "--slots: must be at least 1, got 0"),
    (["generate", "--from", "runs/x", "--prompts", "p.jsonl", "--pages", "-1"], "--pages: must be 0 or more, got -1"),
    (["eval", "--from", "runs/x", "--tasks", "mesh.tp=2"], "argument --tasks: expected at least one argument"),
    (["generate", "--from", "runs/x", "--prompt", "a", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["generate", "--from", "runs/x", "--prompt", "a", "--temperature", "-1"], "--temperature -1.0: must be 0"),
    (["exact-match", "--from", "runs/x", "--data", "d.jsonl", "--limit", "-1"], "--limit: must be 0 or more, got -1"),
    (["exact-match", "--from", "runs/x", "--data", "no/such.jsonl"], "--data: no such file 'no/such.jsonl'"),
    (["eval", "--from", "runs/x", "--tasks", str(REPO / "tests" / "fixtures" / "eval_real" / "capitals.yaml"),
      "--out", "no/such/r.json"], "--out no/such/r.json: no folder 'no/such'"),  # checked before evaluating
    (["eval", "--from", "runs/x", "--tasks", str(REPO / "tests" / "fixtures" / "eval_real" / "capitals.yaml"),
      "--limit", "0"], "--limit: 0.0 is not a number of documents"),
])
def test_a_bad_command_line_is_one_line_and_exit_2(argv, says, capsys):
    code, out, err = _call(argv, capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and says in err, err
    if argv in ([], ["trian"]):  # the line names what would have been right
        assert all(name in err for name in COMMANDS), err


@pytest.mark.parametrize("lines, says", [
    (['{"prompt": "a"', ], "line 1: Expecting ',' delimiter at column 15"),
    (['"a"', '', '{"prompt": "b"'], "line 3: Expecting ',' delimiter"),  # the file's line, blank ones counted
    (['{"prompt": "a"}', '{"text": "b"}'], 'line 2 is not {"prompt": text} nor a string'),
    (['{"prompt": "a", "max_new_tokens": 0}'], "line 1's max_new_tokens is 0; give a whole number ≥ 1"),
    (['"a"', '{"prompt": "b", "max_new_tokens": "5"}'], "line 2's max_new_tokens is '5'"),
    (['{"prompt": "a", "max_new_tokens": true}'], "line 1's max_new_tokens is True"),
    ([], "no prompt in the file"),
])
def test_a_bad_prompts_file_is_one_line_naming_its_line(lines, says, tmp_path, capsys):
    """Read before any model loads (runs/x does not exist): the line and what to give instead."""
    (tmp_path / "p.jsonl").write_text("".join(line + "\n" for line in lines))
    code, out, err = _call(["generate", "--from", "runs/x", "--prompts", str(tmp_path / "p.jsonl")], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and says in err, err


def test_overrides_after_the_task_files_are_overrides(capsys):
    """argparse gives every word after `--tasks` to it: the key=value ones are the command's overrides (as the docs'
    `jaxllm eval --from hf:DIR --tasks t.yaml mesh.tp=2` means), so the command gets as far as the model."""
    task = str(REPO / "tests" / "fixtures" / "eval_real" / "capitals.yaml")
    code, _, err = _call(["eval", "--from", "runs/x", "--tasks", task, "mesh.tp=2", task], capsys)
    assert code == 2 and err.startswith("error: runs/x: not a run directory"), err


def test_config_names_resolve_to_the_shipped_files():
    assert config.config_path("tiny_llama") == str(REPO / "jaxllm" / "configs" / "tiny_llama.toml")
    assert config.config_path(None) == config.DEFAULT_CONFIG == str(REPO / "jaxllm" / "configs" / "default.toml")
    assert config.config_path("mine.toml") == "mine.toml" and config.config_path("runs/x/config") == "runs/x/config"
    assert {"default", "tiny_llama", "sft"} <= set(config.shipped_configs())
    cfg = cli.load_config(argparse.Namespace(config="tiny_llama", overrides=["train.steps=7"]))
    assert cfg.model.family == "llama" and cfg.train.steps == 7


def test_an_unknown_config_name_is_one_line_naming_the_choices(capsys):
    with pytest.raises(ConfigError, match="tiny_llama"):
        config.config_path("tiny-llama")
    code, out, err = _call(["plan", "--config", "tiny-llama"], capsys)
    assert code == 2
    assert err.splitlines() == [f"error: --config tiny-llama: no shipped config of that name; choose from "
                                f"{', '.join(config.shipped_configs())}, or give a TOML file's path"]


def test_the_wheel_holds_the_jaxllm_package_its_configs_and_the_script(tmp_path):
    """Built offline from a copy of the checkout (building in place would leave build/ behind, whose stale
    files a later build packs), with this environment's setuptools."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("jaxllm", "tools", "experiments"):  # tools/ and experiments/ too: the wheel must leave them out
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("jaxllm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"jaxllm"}, names
    assert {f"jaxllm/configs/{c}.toml" for c in config.shipped_configs()} <= set(names)
    assert {"jaxllm/__main__.py", "jaxllm/cli/main.py", "jaxllm/plan/hlo.py"} <= set(names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[console_scripts]\njaxllm = jaxllm.cli.main:main" in text, text
