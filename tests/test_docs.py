"""The README, the docs site's pages, BENCHMARKS.md and the READMEs under tools/ stay true to the code.

- The README is the short front door: at most 15 KB.
- Every file, tool, config and `jaxllm` subcommand a page names exists: `python -m tools.a.b` is a file
  tools/a/b.py, and a module named in backticks (`tools.a.b`, `tools.a.name`) is a file or a name in one.
- Every configuration key a page names (`train.steps`, in backticks) is a key of the schema; the
  reference page itself is generated from the schema (`tools/dev/docs_hooks.py`), and every field there
  has its meaning written (tests/test_config_reference.py).
- Every page is in the site's navigation (mkdocs.yml), and `mkdocs build --strict` in `.ci/run` checks
  the links between them.
- Every section of BENCHMARKS.md with measured numbers (a table) names the command that produced them,
  and that command exists.
"""

import dataclasses
import importlib
import re

import pytest

from harness import REPO
from jaxllm.cli.main import COMMANDS
from jaxllm.mesh import MESH_AXES
from jaxllm.schema import Config

README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text()
PAGES = {p.relative_to(REPO).as_posix(): p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
TOOL_READMES = {p.relative_to(REPO).as_posix(): p.read_text() for p in sorted((REPO / "tools").glob("*/README.md"))}
DOCUMENTS = {"README.md": README, "BENCHMARKS.md": BENCHMARKS, **PAGES, **TOOL_READMES}
SECTIONS = {f.name for f in dataclasses.fields(Config)}


def config_keys(obj=Config(), prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys |= {prefix + f.name} | config_keys(value, f"{prefix}{f.name}.")
        else:
            keys.add(prefix + f.name.rstrip("_"))  # init.from is the field from_
    return keys


def names_code(name: str) -> bool:
    """Whether `name` is a module or attribute path inside jaxllm (`mesh.make_mesh`), not a config key."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("jaxllm." + ".".join(parts[:cut]))
        except ImportError:
            continue
        return all((obj := getattr(obj, rest, None)) is not None for rest in parts[cut:])
    return False


def names_a_tool(name: str) -> bool:
    """Whether dotted `name` (`tools.bench.train_step`, `tools.reference.plain_model`) is a module under tools/, or a
    function, class or constant at the top of one."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        base = REPO.joinpath(*parts[:cut])
        for file in (base.with_suffix(".py"), base / "__init__.py"):
            if file.exists():
                rest = parts[cut:]
                return not rest or (len(rest) == 1 and re.search(rf"^(?:def |class )?{rest[0]}\b", file.read_text(), re.M)
                                    is not None)
    return False


def code_of(text: str) -> str:
    """A page's code: its fenced blocks and inline code spans, where commands are written."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)))


def named_keys(text: str) -> set[str]:
    """The dotted names a page writes in backticks that start with a config section (`train.steps`,
    `train.steps=20`, `mesh.dcn.<axis>` for each axis, `memory.offload_*` as a prefix), less file names
    and jaxllm's own module paths."""
    key = re.compile(r"(?<![\w./-])((?:%s)\.[a-z_0-9<>]+(?:\.[a-z_0-9<>]+)*\*?)" % "|".join(sorted(SECTIONS)))
    found = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for name in key.findall(span):
            if re.search(r"\.(json|safetensors|toml|md|py|png|jsonl)$", name) or names_code(name):
                continue
            found |= {name.replace("<axis>", a) for a in MESH_AXES} if "<axis>" in name else {name}
    return found


def test_readme_is_the_short_front_door():
    assert len(README.encode()) <= 15 * 1024, f"README.md is {len(README.encode()):,} bytes; move detail to docs/"


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_pages_name_only_config_keys_that_exist(name):
    keys = config_keys()
    unknown = sorted(k for k in named_keys(DOCUMENTS[name])
                     if not (k.rstrip("*") in keys if not k.endswith("*") else any(x.startswith(k[:-1]) for x in keys)))
    assert not unknown, f"{name} names configuration keys the schema lacks: {unknown}"


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_pages_name_only_files_and_commands_that_exist(name):
    text = DOCUMENTS[name]
    paths = set(re.findall(r"\b((?:tests|tools|jaxllm|docs|experiments)/[a-z0-9_/.-]+\.(?:py|toml|md|sh|png))", text))
    paths |= {f"tools/{m.replace('.', '/')}.py" for m in re.findall(r"python -m tools\.([a-z_0-9]+(?:\.[a-z_0-9]+)*)", text)}
    paths |= {f"tests/{n}" for n in re.findall(r"(?<![\w/])(test_\w+\.py)\b", text)}  # named bare
    paths |= {f"jaxllm/configs/{n}.toml" for n in re.findall(r"--config ([a-z_0-9]+)(?![\w/.])", text)}
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"{name} names files that do not exist: {missing}"
    modules = set(re.findall(r"(?<![\w./:-])(tools\.[a-z_0-9]+(?:\.[a-z_0-9]+)*)", code_of(text)))
    assert all(map(names_a_tool, modules)), f"{name} names modules under tools/ that do not exist: " \
        f"{sorted(m for m in modules if not names_a_tool(m))}"
    commands = set(re.findall(r"(?<![\w./-])jaxllm ([a-z][a-z-]*)(?![\w/])", code_of(text)))
    assert commands <= set(COMMANDS), f"{name} names jaxllm subcommands that do not exist: {commands - set(COMMANDS)}"


def test_every_page_is_in_the_navigation():
    nav = set(re.findall(r":\s*([\w-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), flags=re.M))
    assert {p.removeprefix("docs/") for p in PAGES} == nav


def test_every_benchmark_section_names_the_command_that_measured_it():
    sections = re.split(r"^## ", BENCHMARKS, flags=re.M)[1:]
    measured = [s for s in sections if re.search(r"^\|.*\d", s, flags=re.M)]
    assert len(measured) >= 4
    for section in measured:
        title = section.splitlines()[0]
        tools = ({m.replace(".", "/") for m in re.findall(r"python -m tools\.([\w.]*\w)", section)}
                 | set(re.findall(r"tools/([\w/]+)\.(?:py|sh)", section)))
        commands = set(re.findall(r"\bjaxllm (plan|train)\b", section))
        assert tools or commands, f"BENCHMARKS.md section '{title}' names no script under tools/ nor a jaxllm command"
        assert all(any((REPO / "tools" / f"{t}.{ext}").exists() for ext in ("py", "sh")) for t in tools), (title, tools)
