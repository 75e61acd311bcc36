"""README.md and BENCHMARKS.md stay true to the code.

- Every key in the README's configuration tables exists in the config, and every config key is
  in those tables.
- Every test file, tool, config, module and document the README names exists.
- Every section of BENCHMARKS.md with measured numbers (a table) names the command under
  tools/ that produced them, and that tool exists.
"""

import dataclasses
import re

from harness import REPO
from jaxllm.schema import Config
from jaxllm.mesh import MESH_AXES

README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text()


def config_keys(obj=Config(), prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys |= config_keys(value, f"{prefix}{f.name}.")
        else:
            keys.add(prefix + f.name.rstrip("_"))  # init.from is the field from_
    return keys


def table_keys(text: str) -> set[str]:
    """The dotted config keys (`section.name`) in the first cell of every table row (`mesh.dcn.<axis>`
    stands for each axis)."""
    sections = {f.name for f in dataclasses.fields(Config)}
    keys = set()
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        first = line.split("|")[1]
        for key in re.findall(r"`([a-z_]+(?:\.[a-z_0-9<>]+)+)`", first):
            if key.split(".")[0] not in sections:
                continue
            keys |= {key.replace("<axis>", a) for a in MESH_AXES} if "<axis>" in key else {key}
    return keys


def test_readme_tables_hold_every_config_key_and_nothing_else():
    documented, actual = table_keys(README), config_keys()
    assert not documented - actual, f"in the README but not in the config: {sorted(documented - actual)}"
    assert not actual - documented, f"in the config but not in the README's tables: {sorted(actual - documented)}"


def test_readme_names_only_files_that_exist():
    paths = set(re.findall(r"\b((?:tests|tools|experiments/configs|jaxllm|docs)/[\w/.-]+\.(?:py|toml|md))", README))
    paths |= {f"tools/{m}.py" for m in re.findall(r"python -m tools\.(\w+)", README)}
    paths |= set(re.findall(r"(?<![\w/-])([\w-]+\.md)\b", README))
    paths |= {f"tests/{name}" for name in re.findall(r"(?<![\w/])(test_\w+\.py)\b", README)}  # named bare
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, missing


def test_every_benchmark_section_names_the_script_that_measured_it():
    sections = re.split(r"^## ", BENCHMARKS, flags=re.M)[1:]
    measured = [s for s in sections if re.search(r"^\|.*\d", s, flags=re.M)]
    assert len(measured) >= 4
    for section in measured:
        title = section.splitlines()[0]
        tools = set(re.findall(r"python -m tools\.(\w+)", section)) | set(re.findall(r"tools/(\w+)\.py", section))
        assert tools, f"BENCHMARKS.md section '{title}' names no script under tools/"
        assert all((REPO / "tools" / f"{t}.py").exists() for t in tools), (title, tools)
