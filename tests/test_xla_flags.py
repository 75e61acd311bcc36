"""XLA's GPU flags (`jaxllm/xla_flags.py`): added to XLA_FLAGS on a machine with a CUDA plugin unless XLA_FLAGS
names them already, nothing on CPU; and every one is a flag this XLA knows (XLA refuses to start on an unknown
flag, so a misspelt or removed one would stop every GPU run: checked here on CPU, where XLA parses them too)."""

import os
import subprocess
import sys

import pytest

from harness import subprocess_env
from jaxllm import xla_flags


def test_the_users_own_values_win_and_the_rest_are_added_once():
    flags = xla_flags.with_gpu_defaults("--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d")
    words = flags.split()
    assert words[:2] == ["--xla_gpu_enable_latency_hiding_scheduler=false", "--xla_dump_to=/tmp/d"]
    assert sorted(w.lstrip("-").split("=")[0] for w in words[2:]) == sorted(
        set(xla_flags.GPU_DEFAULTS) - {"xla_gpu_enable_latency_hiding_scheduler"})
    assert xla_flags.with_gpu_defaults(flags) == flags


def test_added_at_start_up_only_where_cuda_is(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    xla_flags.add_gpu_defaults()  # this machine has no CUDA plugin
    assert xla_flags._cuda_installed() is False
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    monkeypatch.setattr(xla_flags, "_cuda_installed", lambda: True)  # as on a GPU machine
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # a GPU machine told to run on CPU: left alone
    xla_flags.add_gpu_defaults()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    xla_flags.add_gpu_defaults()
    assert os.environ["XLA_FLAGS"] == xla_flags.with_gpu_defaults("--xla_dump_to=/tmp/d")


@pytest.mark.slow
@pytest.mark.parametrize("flags,starts", [(xla_flags.with_gpu_defaults(""), True),
                                          ("--xla_gpu_enable_no_such_thing=true", False)], ids=["defaults", "unknown"])
def test_this_xla_knows_every_flag(flags, starts):
    env = {**subprocess_env(1), "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode == 0) == starts, done.stderr[-2000:]
