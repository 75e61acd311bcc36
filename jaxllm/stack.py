"""The layer stack as segments: each a pattern of block kinds repeated, the segments run in turn.

`model.segments` lists them (`{layers = 3, pattern = ["dense"]}, {layers = 58, pattern = ["moe"]}`:
DeepSeek-V3's three dense layers before its MoE layers), and replace `model.pattern` (a preset's);
without them the stack is one segment, `model.pattern` over `model.n_layers`. `params["blocks"]` holds
every segment's block kinds in turn, each stacked over its segment's repeats, so a one-segment stack has
the tree it always had.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.errors import ConfigError

KINDS = ("dense", "moe", "linear", "linear_moe")  # attention or Gated DeltaNet (`linear`), a dense or MoE feed-forward


@dataclass(frozen=True)
class Segment:
    pattern: tuple[str, ...]  # block kinds, in layer order
    repeats: int  # how many times the pattern repeats
    first_layer: int  # the segment's first layer in the whole stack
    first_block: int  # its first kind's index in params["blocks"]

    @property
    def blocks(self) -> slice:
        """Its kinds' entries of params["blocks"]."""
        return slice(self.first_block, self.first_block + len(self.pattern))


def _specs(m) -> list[dict]:
    return m.segments or [{"layers": m.n_layers, "pattern": m.pattern}]


def segments(m) -> tuple[Segment, ...]:
    """The stack's segments, in order (`check` has accepted `m`)."""
    out, layer, block = [], 0, 0
    for spec in _specs(m):
        pattern = tuple(spec["pattern"])
        out.append(Segment(pattern, spec["layers"] // len(pattern), layer, block))
        layer, block = layer + spec["layers"], block + len(pattern)
    return tuple(out)


def kinds(m) -> list[str]:
    """Every block of `params["blocks"]`'s kind, in order."""
    return [kind for seg in segments(m) for kind in seg.pattern]


def is_moe(kind: str) -> bool:
    """A block kind with the MoE feed-forward."""
    return kind in ("moe", "linear_moe")


def is_linear(kind: str) -> bool:
    """A block kind with Gated DeltaNet (linear attention) in place of attention."""
    return kind in ("linear", "linear_moe")


def has_moe(m) -> bool:
    return any(map(is_moe, kinds(m)))


def has_linear(m) -> bool:
    return any(map(is_linear, kinds(m)))


def attention_layers(m) -> int:
    """How many layers attend (softmax attention, not linear)."""
    return sum(not is_linear(kind) for kind in layer_kinds(m))


def layer_kinds(m) -> list[str]:
    """Each layer's block kind, layer 0 first."""
    return [kind for seg in segments(m) for _ in range(seg.repeats) for kind in seg.pattern]


def from_layer_kinds(kinds_: list[str]) -> list[dict]:
    """The fewest segments that give each layer its kind: one segment per run of equal kinds, and one
    pattern repeated when the kinds repeat a pattern through the whole stack (Qwen's decoder_sparse_step)."""
    n = len(kinds_)
    for length in range(1, n):
        if n % length == 0 and all(kinds_[i] == kinds_[i % length] for i in range(n)):
            return [{"layers": n, "pattern": list(kinds_[:length])}]
    runs: list[dict] = []
    for kind in kinds_:
        if runs and runs[-1]["pattern"] == [kind]:
            runs[-1]["layers"] += 1
        else:
            runs.append({"layers": 1, "pattern": [kind]})
    return runs


def _check_pattern(where: str, pattern) -> None:
    if not isinstance(pattern, list) or not pattern or any(k not in KINDS for k in pattern):
        raise ConfigError(f"{where}: {pattern} — block kinds are {', '.join(map(repr, KINDS))}, e.g. "
                          "[\"dense\", \"moe\"] for an MoE feed-forward every second layer")


def check(m) -> None:
    """`model.pattern` and `model.segments` against `model.n_layers`: ConfigError (one line) if they disagree."""
    if not m.segments:
        _check_pattern("model.pattern", m.pattern)
        if m.n_layers % len(m.pattern):
            raise ConfigError(f"model.n_layers={m.n_layers} is not a multiple of the pattern length {len(m.pattern)}")
        return
    for i, spec in enumerate(m.segments):
        where = f"model.segments[{i}]"
        if not isinstance(spec, dict) or set(spec) != {"layers", "pattern"}:
            raise ConfigError(f"{where}: {spec!r} — each segment is a table {{layers = N, pattern = [...]}}")
        _check_pattern(f"{where}.pattern", spec["pattern"])
        layers = spec["layers"]
        if not isinstance(layers, int) or layers < 1 or layers % len(spec["pattern"]):
            raise ConfigError(f"{where}.layers={layers}: must be a positive multiple of its pattern length "
                              f"{len(spec['pattern'])}")
    total = sum(spec["layers"] for spec in m.segments)
    if total != m.n_layers:
        raise ConfigError(f"model.segments hold {total} layers but model.n_layers={m.n_layers}; make them agree")
