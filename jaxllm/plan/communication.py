"""Communication the step's own algorithms choose, measured in the compiled program beside their formulas.

`allreduce_report`: a hand-built gradient all-reduce (`train.allreduce`, parallel/allreduce.py): its
collective-permute rounds and the bytes each device sends, beside the algorithm's formula and the seeds'
2Φ. `zeropp_report`: ZeRO++'s quantized gathers and gradient all-to-alls (`train.zeropp`), beside the same
config compiled without quantization. The collectives of every step by kind are `jaxllm.plan.hlo`'s;
tensor parallelism's and the pipeline's have modules of their own.
"""

from __future__ import annotations

import copy

import jax

from jaxllm.mesh import batch_shards
from jaxllm.plan.compiled import compile_step
from jaxllm.plan.hlo import bytes_by_kind_and_dtype, collective_report, executed_collectives, permute_bytes_by_device
from jaxllm.plan.memory import dtype_bytes

# the most bytes one device sends all-reducing S over N (parallel/allreduce.py's docstrings)
ALLREDUCE_BYTES = {"ring": lambda n, s: 2 * (n - 1) / n * s, "halving_doubling": lambda n, s: 2 * (n - 1) / n * s,
                   "tree": lambda n, s: 3 * s if n > 2 else s, "ps": lambda n, s: (n - 1) * s}


def allreduce_report(cfg, shape: dict, hlo: str, n_params: int) -> dict | None:
    """For a hand-built `train.allreduce`: its rounds and the bytes each device sends in the compiled step
    (from the permutes' source_target_pairs), beside its formula and the seeds' 2Φ for an all-reduce."""
    t = cfg.train
    if t.allreduce == "xla":
        return None
    sent = permute_bytes_by_device(hlo, jax.device_count())
    n, message = batch_shards(shape), 4 * n_params  # fp32 gradients
    if t.allreduce == "hierarchical":
        inner, outer = n // shape["dp"], shape["dp"]
        formula = 2 * (inner - 1) / inner * message + 2 * (outer - 1) / outer * message / inner
    else:
        formula = ALLREDUCE_BYTES[t.allreduce](n, message)
    return {"algorithm": t.allreduce, "devices": n, "rounds": collective_report(hlo)["collectives"][
        "collective-permute"]["count"], "sent_max": max(sent), "sent_mean": sum(sent) / len(sent),
        "formula_bytes": formula, "seeds_bytes": 2 * message, "bucket_mb": t.bucket_mb}


def zeropp_report(cfg, shape: dict, hlo: str) -> dict | None:
    """With qwZ or qgZ (`train.zeropp`), per device and step from the compiled programs: the all-gather bytes
    beside those of the same config compiled without quantization; the gradient all-to-alls (int8 blocks and
    their fp32 scales) beside the same elements in the compute dtype; the predicted ratio (1 + 4/block) /
    dtype bytes."""
    z = cfg.train.zeropp
    if not (z.weights or z.grads):  # hpZ alone quantizes nothing (its state shows in the ZeRO theory)
        return None
    plain = copy.deepcopy(cfg)
    plain.train.zeropp.weights = plain.train.zeropp.grads = False
    ours, unquantized = (bytes_by_kind_and_dtype(executed_collectives(text)[0])
                         for text in (hlo, compile_step(plain, shape)[1].as_text()))
    of = lambda table, kind: sum(b for (k, _), b in table.items() if k == kind)
    width = dtype_bytes(cfg.precision.compute)
    return {"weights": z.weights, "grads": z.grads, "hpz": z.hpz, "block": z.block, "compute": cfg.precision.compute,
            "gathers": of(ours, "all-gather"), "gathers_unquantized": of(unquantized, "all-gather"),
            "grad_all_to_all": of(ours, "all-to-all"),
            "grad_unquantized": ours.get(("all-to-all", "s8"), 0) * width,
            "predicted_ratio": (1 + 4 / z.block) / width}
