"""The products of the mesh's axes that frontier runs use, each in a process of its own with 16 fake CPU devices
(`tests/mesh_product_worker.py`): step 1's loss and every gradient leaf against one device at the equivalence
tolerance, and the losses of steps 2-4, from a warm optimizer state, within 1e-4."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import REPO, subprocess_env

PP_SP_TP_FSDP = {"mesh.pp": 2, "mesh.sp": 2, "mesh.tp": 2, "mesh.fsdp": 2, "train.zero_stage": 3,
                 "train.sequence_parallel": True, "train.microbatches": 2}
PRODUCTS = {  # name -> the mesh and its options (16 devices)
    "pp2_sp2_tp2_fsdp2_1f1b_ring_zigzag": {**PP_SP_TP_FSDP, "model.cp_load_balance": True},
    "pp2_sp2_tp2_fsdp2_interleaved_ulysses": {**PP_SP_TP_FSDP, "model.cp_strategy": "ulysses",
                                              "train.pp_schedule": "interleaved", "train.pp_virtual": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", PRODUCTS)
def test_a_four_axis_mesh_trains_like_one_device(name):
    done = subprocess.run([sys.executable, str(REPO / "tests" / "mesh_product_worker.py"), json.dumps(PRODUCTS[name])],
                          cwd=REPO / "tests", env=subprocess_env(16), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for mesh, one in zip(seen["mesh"], seen["one"]):
        assert abs(mesh - one) <= 1e-4 * abs(one), seen
