"""Every configuration key says what it means, in the schema, and the generated reference lists each key once.

- Every field of every section dataclass has a non-empty `meaning` in its metadata.
- `reference_markdown()` has one table row per key (and a heading per section, with its docstring), and its
  tables are well formed: four cells a row, so a `|` inside a meaning is escaped.
- `meaning(key)` is the field's metadata, for dotted keys including `init.from` (the field `from_`).
"""

import dataclasses
import re
from collections import Counter

import pytest

from jaxllm import schema
from jaxllm.schema import Config, InitConfig, TrainConfig


def value_fields(cls=Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every non-section field, by dotted key (`init.from` for the field `from_`), walked here on its own."""
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out |= value_fields(type(value), f"{prefix}{f.name}.")
        else:
            out[prefix + f.name.rstrip("_")] = f
    return out


def section_classes(cls=Config, prefix: str = "") -> dict[str, type]:
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out[prefix + f.name] = type(value)
            out |= section_classes(type(value), f"{prefix}{f.name}.")
    return out


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| `")]


def test_every_key_has_a_meaning():
    fields = value_fields()
    assert len(fields) > 100 and "init.from" in fields and "mesh.dcn.tp" in fields
    missing = sorted(k for k, f in fields.items() if not f.metadata.get("meaning", "").strip())
    assert not missing, f"config keys without a meaning in jaxllm/schema.py (key(default, meaning)): {missing}"


def test_keys_are_every_field_in_schema_order():
    assert schema.keys() == list(value_fields())


def test_reference_lists_every_key_exactly_once():
    listed = Counter(re.match(r"\| `([^`]+)` \|", row).group(1) for row in table_rows(schema.reference_markdown()))
    repeated = sorted(k for k, n in listed.items() if n > 1)
    assert not repeated, f"listed more than once in reference_markdown(): {repeated}"
    expected = set(value_fields())
    assert not expected - set(listed), f"missing from reference_markdown(): {sorted(expected - set(listed))}"
    assert not set(listed) - expected, f"in reference_markdown() but not a key: {sorted(set(listed) - expected)}"


def test_reference_rows_have_four_cells_and_the_field_facts():
    text = schema.reference_markdown()
    for row in table_rows(text):
        cells = re.split(r"(?<!\\)\|", row)[1:-1]  # a `|` inside a cell is escaped
        assert len(cells) == 4, f"a reference row does not have 4 cells (an unescaped '|'?): {row}"
    row = next(r for r in table_rows(text) if r.startswith("| `train.steps` |"))
    assert row.startswith("| `train.steps` | int | `200` | optimizer steps")
    row = next(r for r in table_rows(text) if r.startswith("| `model.pattern` |"))
    assert '| list | `["dense"]` |' in row


def test_reference_has_a_heading_and_docstring_per_section():
    text = schema.reference_markdown()
    headings = re.findall(r"^## (\S+)$", text, flags=re.M)
    sections = section_classes()
    assert headings == list(sections) and "model.moe" in headings and "train.zeropp" in headings
    for name, cls in sections.items():
        assert not cls.__doc__.startswith(cls.__name__ + "("), f"section {name} has no docstring"
        body = text.split(f"## {name}\n", 1)[1]
        assert body.lstrip().startswith(cls.__doc__.split()[0])


def test_meaning_reads_the_field_metadata():
    steps = {f.name: f for f in dataclasses.fields(TrainConfig)}["steps"]
    assert schema.meaning("train.steps") == steps.metadata["meaning"]
    assert schema.meaning("init.from") == dataclasses.fields(InitConfig)[0].metadata["meaning"]
    assert "hf:DIR" in schema.meaning("init.from")


@pytest.mark.parametrize("bad", ["train.stepz", "model.moe", "train.steps.x", "nosuch"])
def test_meaning_refuses_what_is_not_a_key(bad):
    with pytest.raises(KeyError):
        schema.meaning(bad)


def test_defaults_are_fresh_per_instance():
    a, b = Config(), Config()
    a.model.pattern.append("moe")
    a.rl.rewards.append("format")
    assert b.model.pattern == ["dense"] and b.rl.rewards == ["exact_match"]
