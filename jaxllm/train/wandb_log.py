"""Weights & Biases (`run.wandb = online | offline`): metrics.jsonl's scalars and the resolved config, from process 0.

Each row written to metrics.jsonl goes to W&B at its step (W&B merges rows of one step, as a training row and
its validation row, into one), the same numbers TensorBoard gets. `offline` writes the W&B run into
RUN_DIR/wandb for `wandb sync` later; `online` streams it (after `wandb login`).

The W&B run's id is kept in RUN_DIR/wandb_id. A resumed run (`train.resume`) opens the same W&B run and logs
the steps after its checkpoint only. Online, W&B keeps the values the stopped run had logged past that
checkpoint for the steps trained again (it drops rows at a step it has seen); a deterministic run logs the same
values there, but for the timing columns.
"""

from __future__ import annotations

import importlib.util
import os

from jaxllm.errors import ConfigError, UserError

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
    """The W&B run a MetricsWriter sends each row's numbers to."""

    def __init__(self, run):
        self.run = run

    def log(self, numbers: dict, step: int) -> None:
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
    return Mirror(run)
