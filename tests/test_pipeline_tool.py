"""tools/studies/pipeline.py: the schedule drawn as a PNG timeline, its numbers, and its refusals."""

import json
import os
import subprocess
import sys

import pytest

from harness import subprocess_env
from jaxllm.parallel.pipeline_schedules import Costs, bubble_formula, make_schedule
from tools.studies.pipeline import boxes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(*args, cwd=REPO):
    env = subprocess_env(1)
    return subprocess.run([sys.executable, "-m", "tools.studies.pipeline", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
                                            ("zb_v", 4, 8, 1)])
def test_cli_writes_png_and_bubble_matches_formula(tmp_path, schedule, p, m, v):
    import matplotlib.image

    out = tmp_path / "timeline.png"
    proc = run_tool("--schedule", schedule, "--stages", str(p), "--microbatches", str(m), "--virtual", str(v),
                    "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["png"] == str(out) and str(out) in proc.stdout
    expected = (p - 1) / (8 * m + p - 1) if schedule == "zb_v" else (p - 1) / (v * m + p - 1)
    assert r["bubble_table"] == pytest.approx(expected) and r["bubble_formula"] == pytest.approx(expected)
    assert (r["stash_depth"] > 0, r["idle_in_span"] == 0) == ((schedule == "zb_v",) * 2)
    assert r["act_depth"] >= 1
    if schedule == "1f1b":
        assert r["act_depth"] <= r["act_depth_bound"] == 2 * p - 1
    if schedule == "gpipe":
        assert r["act_depth"] <= r["act_depth_bound"] == m
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 0 and image.shape[1] > 0


def test_cli_default_path(tmp_path):
    proc = run_tool("--schedule", "interleaved", "--stages", "2", "--microbatches", "4", "--virtual", "2",
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path) == ["pipeline-interleaved-p2-m4-v2.png"]


def test_cli_bad_combination_exits_2_and_writes_nothing(tmp_path, capsys):
    from tools.studies.pipeline import main

    out = tmp_path / "bad.png"
    assert main(["--schedule", "interleaved", "--stages", "4", "--microbatches", "6", "--virtual", "2",
                 "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "multiple of 4" in lines[0], lines
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1),
                                            ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3), ("zb_h1", 4, 8, 1),
                                            ("zb_v", 4, 8, 1)])
@pytest.mark.parametrize("costs", [Costs(), Costs(1.0, 1.0, 1.0, 0.5), Costs(2.0, 1.0, 3.0, 1.0)])
def test_boxes_cover_the_work_without_overlap(schedule, p, m, v, costs):
    s = make_schedule(schedule, p, m, v)
    bxs = boxes(s, costs)
    kinds = "BFRW" if s.split else "BF"
    for stage in range(p):
        mine = sorted((b for b in bxs if b.stage == stage), key=lambda b: b.x0)
        assert sum(b.width for b in mine) == pytest.approx(m * costs.total)
        for a, b in zip(mine, mine[1:]):
            assert a.x0 + a.width <= b.x0 + 1e-9, (a, b)
        # every microbatch goes through every chunk exactly once per kind of operation
        assert sorted((b.kind, b.microbatch, b.chunk) for b in mine) == sorted(
            (k, i, c) for k in kinds for i in range(m) for c in range(s.chunks))
    end = max(b.x0 + b.width for b in bxs)
    busy = sum(b.width for b in bxs)
    if costs == Costs() or not s.split:  # a fused schedule's bubble does not depend on the costs
        assert 1 - busy / (p * end) == pytest.approx(bubble_formula(s))
