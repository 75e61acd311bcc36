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
# DeepSeek-shaped: latent attention, a dense layer then MoE (sigmoid group-limited routing, a shared expert, the bias
# moved by its load, no Switch loss), a multi-token prediction module whose block is MoE too
DEEPSEEK = {"model.preset": "tiny-moe", "model.attention": "mla", "model.mla.q_lora_rank": 16,
            "model.mla.kv_lora_rank": 24, "model.mla.qk_nope_head_dim": 8, "model.mla.qk_rope_head_dim": 4,
            "model.mla.v_head_dim": 10, "model.n_layers": 5,
            "model.segments": [{"layers": 1, "pattern": ["dense"]}, {"layers": 4, "pattern": ["moe"]}],
            "model.moe.score": "sigmoid", "model.moe.n_group": 4, "model.moe.topk_group": 2,
            "model.moe.routed_scale": 2.5, "model.moe.n_shared_experts": 1, "model.moe.bias_update_rate": 0.001,
            "model.moe.capacity_factor": 0.0, "model.moe.balance_weight": 0.0, "model.mtp_depth": 1}
PRODUCTS = {  # name -> the mesh and its options (16 devices)
    "pp2_sp2_tp2_fsdp2_1f1b_ring_zigzag": {**PP_SP_TP_FSDP, "model.cp_load_balance": True},
    "pp2_sp2_tp2_fsdp2_interleaved_ulysses": {**PP_SP_TP_FSDP, "model.cp_strategy": "ulysses",
                                              "train.pp_schedule": "interleaved", "train.pp_virtual": 2},
    "deepseek_pp2_ep2_sp2_tp2_zb_v": {**DEEPSEEK, "mesh.pp": 2, "mesh.ep": 2, "mesh.sp": 2, "mesh.tp": 2,
                                      "train.zero_stage": 2, "train.sequence_parallel": True,
                                      "train.microbatches": 4, "train.pp_schedule": "zb_v"},
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
