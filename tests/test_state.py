"""The train state across versions: a checkpoint saved by jaxllm before `TrainState` existed (a dict of
step, params and opt_state, written by the code of commit 5274dd5 under the tests' compile flags and
kept in tests/fixtures) resumes with the new fields at their defaults and trains on exactly as the
old code did; a checkpoint with fields this version does not know is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from harness import REPO, subprocess_env
from jaxllm.errors import ConfigError
from jaxllm.trainer import state as state_lib

OLD_RUN = Path(__file__).parent / "fixtures" / "run_saved_before_train_state"
# an MoE run (pattern ["moe"], `moe.shared_expert = true`) saved by the code before the stack had segments (7816c3e)
OLD_MOE_RUN = Path(__file__).parent / "fixtures" / "run_moe_before_segments"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("old_run", [OLD_RUN, OLD_MOE_RUN], ids=["before_train_state", "moe_before_segments"])
def test_a_checkpoint_from_before_train_state_resumes_as_the_old_code_trained(old_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(old_run, run_dir)
    old_rows = _rows(old_run / "metrics.jsonl")  # steps 1-4 as the old code trained them; its step-2 checkpoint
    cmd = [sys.executable, "-m", "jaxllm", "train", "--config", str(run_dir / "config.toml"), "train.resume=true",
           f"run.dir={run_dir}", f"data.source={old_run / 'text.txt'}", "run.progress=false"]
    done = subprocess.run(cmd, cwd=REPO, env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from step 2" in done.stderr
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Steps 3 and 4, trained again from the migrated state, are what the old code logged, to float32 rounding:
    # the fixture was recorded on another host, and XLA:CPU's last bits depend on the host's instruction set (on
    # the machine of 2026-11-24 the old code itself, 5274dd5 run afresh, logs a step-1 gradient norm 1 ulp away
    # from the fixture's). Step 3 is a forward pass from the restored state, step 4 one update of an Adam that
    # two steps have warmed (no coordinate left at a near-zero second moment): a few ulps, not Adam's
    # amplification of a cold first step (tests/test_grpo_run.py).
    ulps = 4 * np.finfo(np.float32).eps
    for new, old in zip(rows[2:], old_rows[2:]):
        for key in ("loss", "grad_norm"):
            assert abs(new[key] - old[key]) <= ulps * abs(old[key]), (key, new, old)
    mngr = ocp.CheckpointManager(run_dir / "checkpoints", options=ocp.CheckpointManagerOptions(read_only=True))
    saved = mngr.restore(4, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                      meta=ocp.args.JsonRestore()))
    mngr.close()
    assert saved["meta"]["state_fields"] == list(state_lib.FIELDS)
    assert int(saved["state"]["step"]) == 4 and int(saved["state"]["applied"]) == 4  # 2 migrated + 2 applied


def test_a_checkpoint_with_fields_this_version_lacks_is_refused():
    state_lib.check_fields({"state_fields": list(state_lib.FIELDS)}, "run.dir 'x'")
    state_lib.check_fields({}, "run.dir 'x'")  # the dict checkpoints of before: completed with defaults
    with pytest.raises(ConfigError, match="resume it with the jaxllm version that saved it"):
        state_lib.check_fields({"state_fields": [*state_lib.FIELDS, "loss_scale"]}, "run.dir 'x'")
