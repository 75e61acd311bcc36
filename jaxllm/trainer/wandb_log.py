"""Weights & Biases (`run.wandb = online | offline`): metrics.jsonl's scalars and the resolved config, from process 0.

Each row written to metrics.jsonl goes to W&B at its step (W&B merges rows of one step, as a training row and
its validation row, into one), the same numbers TensorBoard gets. `offline` writes the W&B run into
RUN_DIR/wandb for `wandb sync` later; `online` streams it (after `wandb login`).

The W&B run's id is kept in RUN_DIR/wandb_id. A resumed run (`train.resume`) opens the same W&B run and first
sends what W&B lacks of metrics.jsonl: a run killed hard (SIGKILL, a lost node) loses the rows W&B's service had
not yet written, so W&B can end several steps before the restored checkpoint. What W&B holds is read back:
online, every step before the resumed run's starting step (W&B drops a row at an earlier step anyway); offline,
the steps in the run's earlier offline files, read with W&B's own reader (`wandb leet inspect`). Those steps are
not sent again, so each step lands in one offline file and `wandb sync` of them all gives every step once.
W&B keeps the values the stopped run had logged past the checkpoint for the steps trained again; a
deterministic run logs the same values there, but for the timing columns.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import subprocess
import sys

from jaxllm.errors import ConfigError, UserError

log = logging.getLogger("jaxllm")
ID_FILE = "wandb_id"
MODES = ("off", "online", "offline")


def check_config(cfg) -> None:
    """`run.wandb` is a mode, its tags are strings, and the wandb package is there when it is on."""
    r = cfg.run
    if r.wandb not in MODES:
        raise ConfigError(f"run.wandb: one of {', '.join(MODES)}, got {r.wandb!r}")
    if not all(isinstance(t, str) for t in r.wandb_tags):
        raise ConfigError(f"run.wandb_tags: a list of strings, got {r.wandb_tags!r}")
    if r.wandb != "off" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"run.wandb={r.wandb} needs the wandb package: pip install \"jaxllm[wandb]\" "
                          "(or set run.wandb=off)")


class Mirror:
    """The W&B run a MetricsWriter sends each row's numbers to, but for the steps W&B holds already (`held`)."""

    def __init__(self, run, held=frozenset()):
        self.run, self.held = run, held

    def log(self, numbers: dict, step: int) -> None:
        if step not in self.held:
            self.run.log(numbers, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def open_run(cfg, config: dict, resumed: bool) -> Mirror | None:
    """Start (or, resumed, continue) the W&B run of `cfg.run.dir`; None when `run.wandb = off`."""
    r = cfg.run
    if r.wandb == "off":
        return None
    import wandb  # the wandb extra, checked by check_config

    path, run_id = os.path.join(r.dir, ID_FILE), None  # None: W&B makes one
    if resumed and os.path.isfile(path):
        with open(path) as f:
            run_id = f.read().strip()
    earlier = _offline_files(r.dir, run_id) if run_id and r.wandb == "offline" else []
    try:
        run = wandb.init(mode=r.wandb, dir=r.dir, id=run_id, resume="allow" if resumed else None,
                         project=r.wandb_project, entity=r.wandb_entity or None,
                         name=r.wandb_name or os.path.basename(os.path.normpath(r.dir)), tags=list(r.wandb_tags),
                         config=config)
    except wandb.Error as e:
        raise UserError(f"run.wandb={r.wandb}: W&B did not start: {str(e).strip().splitlines()[0]}; run "
                        "`wandb login`, or set run.wandb=offline (and `wandb sync` later) or off") from None
    with open(path, "w") as f:
        f.write(run.id)
    if r.wandb == "online":
        return Mirror(run, range(run.starting_step))  # W&B takes no step before its next one
    return Mirror(run, frozenset().union(*map(_steps_in, earlier)))


def _offline_files(run_dir: str, run_id: str) -> list[str]:
    """The offline W&B files of run `run_id` in run_dir, one per earlier (resumed) run."""
    return sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")))


def _steps_in(path: str) -> set[int]:
    """The steps an offline W&B file holds, read by W&B's own reader, which reads a file torn by a kill up to
    its last whole record. Unreadable: none, with a warning (then steps can reach W&B twice)."""
    beside = os.path.join(os.path.dirname(sys.executable), "wandb")  # the wandb of this environment
    try:
        out = subprocess.run([beside if os.path.isfile(beside) else "wandb", "leet", "inspect", "--json", path], capture_output=True, text=True,
                             timeout=300, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.strip()]
        return {int(r["history"]["step"]["num"]) for r in records if r.get("type") == "history"}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as e:
        log.warning("W&B: cannot read %s (%s); its steps are sent again", path, e)
        return set()
