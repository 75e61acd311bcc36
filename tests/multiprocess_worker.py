"""One process of the multi-process loader check in tests/test_multiprocess.py.

    python tests/multiprocess_worker.py COORDINATOR_ADDRESS NUM_PROCESSES PROCESS_ID CHATS_JSONL MIXTURE_DIR

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 in each process. Joins
jax.distributed, builds the (dp=2, fsdp=4) mesh with jaxllm.mesh.make_mesh and loads
batches with jaxllm.data.loader.global_batch from a token stream that records every
position it is asked for. Asserts that this process reads exactly the token windows of
the rows its own devices hold (also on a hybrid mesh whose dp axis spans the
processes, as across nodes), nothing of the other process's rows, that each
local shard equals the numpy reference, and that the assembled global array (summed across
processes by a jitted reduction) equals the reference. Then the fine-tuning rows of CHATS_JSONL
(packed): this process builds the same rows as any other, builds only the batch rows its devices
hold, and each local shard is the reference. Then a mixture of MIXTURE_DIR's two JSONL sources whose weights
changed at step 2 (as a run resumed there): the digest of each whole batch (`mixture_digests`), which the test
compares with one process's. Prints one JSON line with what it saw; exits non-zero on any failed check.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.schema import Config, DistributedConfig
from jaxllm.data.loader import batch_rows, global_batch, window_starts
from jaxllm.mesh import initialize_distributed, make_mesh
from jaxllm.sharding import BATCH_AXES

SEED, GLOBAL_BATCH, SEQ_LEN = 7, 16, 32  # windows of 33 tokens, rows of 32 positions (4 column blocks of 8)


class SpyTokens:
    """A 1-D token array that records every position read through indexing."""

    def __init__(self, data: np.ndarray):
        self.data = data
        self.read: set[int] = set()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        positions = np.arange(len(self.data))[index]
        self.read.update(int(i) for i in np.ravel(positions))
        return self.data[index]


def _slice_range(s: slice, n: int) -> range:
    return range(*s.indices(n))


def check(tokens: np.ndarray, sharding, step: int) -> dict:
    spy = SpyTokens(tokens)
    batch = global_batch(spy, SEED, step, GLOBAL_BATCH, SEQ_LEN, sharding)
    arr, shape = batch["inputs"], (GLOBAL_BATCH, SEQ_LEN)
    assert all(a.shape == shape for a in batch.values()) and arr.dtype == np.int32, (arr.shape, arr.dtype)

    starts = window_starts(len(tokens), SEED, step, GLOBAL_BATCH, SEQ_LEN)
    windows = batch_rows(tokens, starts, slice(None), SEQ_LEN)
    reference = windows[:, :-1]

    # The (row, column) cells this process's devices hold; it reads the whole windows of their rows.
    cells: set[tuple[int, int]] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows, cols = tuple(index) + (slice(None),) * (2 - len(index))
        cells.update((r, c) for r in _slice_range(rows, shape[0]) for c in _slice_range(cols, shape[1]))
    own_rows = sorted({r for r, _ in cells})
    expected_reads = {int(starts[r]) + c for r in own_rows for c in range(SEQ_LEN + 1)}
    assert spy.read == expected_reads, (
        f"process {jax.process_index()} read {len(spy.read)} positions, expected exactly the "
        f"{len(expected_reads)} of its own rows' windows; extra: {sorted(spy.read - expected_reads)[:10]}")
    for shard in batch["targets"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), windows[:, 1:][shard.index])

    # Each local shard holds the reference block, and every local device has one.
    assert len(arr.addressable_shards) == jax.local_device_count()
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), reference[shard.index])

    # The global array, assembled across processes, is the reference (a cross-process reduction).
    total = int(jax.jit(lambda a: a.sum())(arr))
    assert total == int(reference.sum()), (total, int(reference.sum()))
    row_sums = np.asarray(jax.jit(lambda a: a.sum(axis=1), out_shardings=NamedSharding(sharding.mesh, P()))(arr))
    np.testing.assert_array_equal(row_sums, reference.sum(axis=1))
    return {"rows": own_rows, "n_cells": len(cells), "n_reads": len(spy.read)}


def check_sft(chats: str, sharding) -> dict:
    from jaxllm.config import build_config
    from jaxllm.data import dataset, packing
    from jaxllm.data.tokenizers import get_tokenizer

    cfg = build_config(None, {"data.format": "chat", "data.source": chats, "data.pack": True, "data.val_percent": 0,
                              "model.seq_len": 64, "train.global_batch": GLOBAL_BATCH, "train.seed": SEED})
    data = dataset.load(cfg, get_tokenizer("byte"))
    built: list[int] = []
    build = packing.build

    def spy(rows, which):  # records the rows this process builds
        built.extend(int(r) for r in which)
        return build(rows, which)

    packing.build = spy
    try:
        batch = data.train_batch(1, sharding)
    finally:
        packing.build = build
    which = packing.step_rows(len(data.train), GLOBAL_BATCH, SEED, 1)
    reference = build(data.train, which)
    own = sorted({r for index in sharding.addressable_devices_indices_map((GLOBAL_BATCH, 64)).values()
                  for r in _slice_range(index[0], GLOBAL_BATCH)})
    assert sorted(set(built)) == sorted({int(which[r]) for r in own}), (built, own)
    for name, arr in batch.items():
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), reference[name][shard.index])
    return {"members": data.train.members, "rows": own}


def mixture_digests(folder: str, sharding, steps=range(4)) -> list[str]:
    """sha256 of each of `steps`' whole batches (every field, gathered from every process) of the mixture in
    `folder` (a.jsonl ×0.25 and b.jsonl ×0.75, then ×0.5 each from step 2), documents masked."""
    import hashlib

    from jax.experimental import multihost_utils

    from jaxllm.config import build_config
    from jaxllm.data import dataset
    from jaxllm.data.tokenizers import get_tokenizer

    sources = lambda w: [{"path": f"{folder}/a.jsonl", "weight": w}, {"path": f"{folder}/b.jsonl", "weight": 1 - w}]
    cfg = build_config(None, {"data.sources": sources(0.5), "data.document_mask": True, "model.seq_len": SEQ_LEN,
                              "train.global_batch": GLOBAL_BATCH, "train.seed": SEED})
    data = dataset.load(cfg, get_tokenizer("byte"))
    data.resume_stages({"data_stages": [[0, [0.25, 0.75]]]}, 2)
    out = []
    for step in steps:
        batch = data.train_batch(step, sharding)
        whole = {k: np.asarray(multihost_utils.process_allgather(a, tiled=True)) for k, a in sorted(batch.items())}
        out.append(hashlib.sha256(b"".join(a.tobytes() for a in whole.values())).hexdigest())
    return out


def main(argv: list[str]) -> int:
    address, num_processes, process_id = argv[0], int(argv[1]), int(argv[2])
    initialize_distributed(DistributedConfig(coordinator_address=address, num_processes=num_processes,
                                             process_id=process_id))
    assert jax.process_count() == num_processes and jax.process_index() == process_id
    shape = {"pp": 1, "dp": 2, "fsdp": 4, "ep": 1, "sp": 1, "tp": 1}
    mesh = make_mesh(shape)
    # Small values so int32 sums cannot overflow; 1000 tokens so windows rarely overlap.
    tokens = (np.arange(1000, dtype=np.uint16) * 7919 % 251).astype(np.uint16)
    out = {
        "process": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "devices": jax.device_count(),
        # The training layout: rows over dp×fsdp×ep.
        "batch": [check(tokens, NamedSharding(mesh, P(BATCH_AXES)), step) for step in (0, 1)],
        # Rows over dp, columns over fsdp: each device reads a block of its rows' windows.
        "blocks": check(tokens, NamedSharding(mesh, P("dp", "fsdp")), 2),
    }
    # A hybrid mesh: dp spans the two processes (as across nodes), fsdp stays within each.
    cfg = Config()
    cfg.mesh.dcn.dp = 2
    hybrid = make_mesh(shape, cfg)
    owners = np.vectorize(lambda d: d.process_index)(hybrid.devices)
    for i in range(2):
        assert (owners[:, i] == i).all(), owners
    out["hybrid"] = check(tokens, NamedSharding(hybrid, P(BATCH_AXES)), 3)
    out["sft"] = check_sft(argv[3], NamedSharding(mesh, P(BATCH_AXES)))
    out["mixture"] = mixture_digests(argv[4], NamedSharding(mesh, P(BATCH_AXES)))
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
