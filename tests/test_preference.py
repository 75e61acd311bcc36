"""Preference optimisation (DPO, IPO, SimPO): each loss and its gradients against a reference written here with
transformers/torch on the same tiny LLaMA (the policy a perturbed copy of the reference), TRL's trainers on the
same pairs, every mesh against one device, and the run: metrics, validation and a resume."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

import hf_families as H
from harness import assert_matches, step_fns, tiers, unmeasured
from jaxllm.config import build_config
from jaxllm.data import dataset, packing
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.errors import DataError, UserError
from jaxllm.interop import hf

BYTE = get_tokenizer("byte")
EOT = 256
SEQ, ROWS = 64, 8
LOSSES = {"sigmoid": {"dpo.loss": "sigmoid"},
          "sigmoid_smoothed": {"dpo.loss": "sigmoid", "dpo.label_smoothing": 0.2},
          "ipo": {"dpo.loss": "ipo", "dpo.beta": 0.5},
          "simpo": {"dpo.loss": "simpo", "dpo.beta": 2.0, "dpo.gamma": 0.7}}


def pairs(n: int = 12, seed: int = 0) -> list[dict]:
    """Sums as text: a prompt "a+b=", the right answer chosen, a near miss rejected (lengths differ)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 500, 2))
        wrong = a + b + int(rng.choice([-11, -1, 1, 7, 100]))
        out.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(abs(wrong))})
    return out


def write_pairs(path, rows=None) -> str:
    path.write_text("".join(json.dumps(p) + "\n" for p in (rows or pairs())))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(reference folder, policy folder): a tiny LLaMA over the byte vocabulary, and a copy of it with every
    weight moved by 5% of its spread, so the log-ratios to the reference are not zero."""
    import torch

    root = tmp_path_factory.mktemp("dpo_models")
    ref = H.build("llama3", str(root / "reference"), vocab_size=EOT + 1)
    model = H._load(ref)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=generator))
    model.save_pretrained(str(root / "policy"))
    return ref, str(root / "policy")


def config(models, source: str, **over):
    return build_config(None, {"init.from": f"hf:{models[0]}", "model.seq_len": SEQ, "precision.compute": "float32",
                               "train.global_batch": ROWS, "mesh.dp": 1, "train.objective": "dpo",
                               "data.format": "preference", "data.source": source, "data.pack": True,
                               "data.val_percent": 0, **over})


def batch_of(cfg) -> dict:
    """Every pair of the file packed into one batch of ROWS rows."""
    data = dataset.load(cfg, BYTE)
    assert len(data.train) <= ROWS
    which = np.concatenate([np.arange(len(data.train)), np.full(ROWS - len(data.train), packing.EMPTY)])
    return packing.build(data.train, which)


def jaxllm_loss(cfg, models, batch, devices=None):
    """(loss, metrics, gradients) of the policy on one mesh, the batch scored by the reference first."""
    fns = step_fns(cfg, devices)
    ref, policy = (hf.load_params(d, cfg.model, fns.state_shardings.params) for d in models)
    batch = jax.device_put(batch, fns.batch_sharding)
    if "ref_logp" in fns.objective.fields:  # scored and done before the step's program starts
        batch = {**batch, "ref_logp": jax.block_until_ready(fns.token_logp(ref, batch))}
    loss, metrics, grads = fns.loss_and_grads(policy, batch)
    return float(loss), jax.device_get(metrics), jax.device_get(grads)


def torch_reference(models, rows: list[dict], loss: str, beta: float, epsilon: float = 0.0, gamma: float = 0.0):
    """(loss, metrics, gradients by parameter name), each pair's two sequences run alone through the transformers
    models: the byte ids of prompt + completion then the end-of-text, the completion's targets (and the
    end-of-text) counted."""
    import torch
    import torch.nn.functional as F

    policy, ref = H._load(models[1]), H._load(models[0])

    def logps(model, prompt: str, completion: str):
        ids = torch.tensor([list((prompt + completion).encode()) + [EOT]])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
        return picked[len(prompt) - 1:].sum(), len(completion) + 1

    losses, rewards, lps = [], [], []
    for p in rows:
        (lc, nc), (lr, nr) = (logps(policy, p["prompt"], p[k]) for k in ("chosen", "rejected"))
        with torch.no_grad():
            rc, rr = (logps(ref, p["prompt"], p[k])[0] for k in ("chosen", "rejected"))
        if loss == "simpo":
            z = beta * (lc / nc - lr / nr) - gamma
            losses.append(-(1 - epsilon) * F.logsigmoid(z) - epsilon * F.logsigmoid(-z))
            rewards.append((beta * lc.detach() / nc, beta * lr.detach() / nr))
            lps.append((lc.detach() / nc, lr.detach() / nr))
            continue
        if loss == "sigmoid":
            z = beta * ((lc - rc) - (lr - rr))
            losses.append(-(1 - epsilon) * F.logsigmoid(z) - epsilon * F.logsigmoid(-z))
        else:
            losses.append(((lc - rc) / nc - (lr - rr) / nr - 1 / (2 * beta)) ** 2)
        rewards.append((beta * (lc - rc).detach(), beta * (lr - rr).detach()))
        lps.append((lc.detach(), lr.detach()))
    total = torch.stack(losses).mean()
    total.backward()
    mean = lambda xs: float(np.mean([float(x) for x in xs]))
    metrics = {"rewards/chosen": mean(c for c, _ in rewards), "rewards/rejected": mean(r for _, r in rewards),
               "rewards/accuracies": mean(float(c > r) for c, r in rewards),
               "rewards/margins": mean(c - r for c, r in rewards),
               "logps/chosen": mean(c for c, _ in lps), "logps/rejected": mean(r for _, r in lps)}
    return total.item(), metrics, {n: p.grad.numpy() for n, p in policy.named_parameters()}


def assert_metrics_match(ours: dict, theirs: dict, beta: float):
    """Each metric within 1e-5 of its size; a reward (β × a difference of two fp32 sums of log-probabilities)
    within 1e-5 of β × those sums' size, which its rounding scales with."""
    for k, v in theirs.items():
        size = max(abs(v), beta * abs(theirs["logps/chosen"])) if k.startswith("rewards/") else abs(v)
        assert abs(float(ours[k]) - v) <= 1e-5 * size, (k, float(ours[k]), v)


def assert_grads_match(cfg, grads, theirs):
    ours = dict(hf.file_tensors(jax.tree.map(jax.numpy.asarray, grads), cfg.model))
    assert sorted(ours) == sorted(theirs)
    for name, g in theirs.items():
        np.testing.assert_allclose(ours[name], g, rtol=1e-5, atol=1e-5 * np.abs(g).max(), err_msg=name)


@pytest.mark.parametrize("loss", tiers(LOSSES, fast=("sigmoid",)))
def test_each_loss_and_its_gradients_equal_torch(models, tmp_path, loss):
    rows = pairs()
    cfg = config(models, write_pairs(tmp_path / "pairs.jsonl", rows), **LOSSES[loss])
    ours, metrics, grads = jaxllm_loss(cfg, models, batch_of(cfg), devices=1)
    d = cfg.dpo
    theirs, their_metrics, their_grads = torch_reference(models, rows, d.loss, d.beta, d.label_smoothing, d.gamma)
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
    assert_metrics_match(metrics, their_metrics, d.beta)
    assert 0 < their_metrics["rewards/accuracies"] < 1  # the pairs disagree, so the accuracy is a real count
    assert_grads_match(cfg, grads, their_grads)


MESHES = {
    "dp2_fsdp2_tp2_zero3": {"mesh.dp": 2, "mesh.fsdp": 2, "mesh.tp": 2, "train.zero_stage": 3, "train.loss_chunk": 16},
    "zero1_island_2_microbatches": {"mesh.dp": 2, "mesh.fsdp": 2, "train.zero_stage": 1, "train.microbatches": 2},
    "pp2_dp4": {"mesh.pp": 2, "mesh.dp": 4, "train.microbatches": 2},
    # (not with the chunked loss: XLA:CPU runs its head-gradient loop beside the ring's, and their collectives can
    # interleave differently on different devices: a deadlock, see docs/design-notes.md)
    "sp4_ring": {"mesh.sp": 4, "mesh.dp": 2, "model.cp_load_balance": True},
    "zero3_island_fp32_reduce": {"mesh.fsdp": 2, "mesh.dp": 2, "train.zero_stage": 3, "train.microbatches": 2,
                                 "precision.grad_reduce": "float32"},
}


@pytest.mark.parametrize("mesh", tiers(MESHES, fast=("zero1_island_2_microbatches",)))
def test_every_mesh_equals_one_device(models, tmp_path, mesh):
    cfg = config(models, write_pairs(tmp_path / "pairs.jsonl"), **{"dpo.label_smoothing": 0.1})
    batch = batch_of(cfg)
    loss, metrics, grads = jaxllm_loss(cfg, models, batch, devices=1)
    on_mesh = config(models, cfg.data.source, **{"dpo.label_smoothing": 0.1}, **MESHES[mesh])
    m_loss, m_metrics, m_grads = jaxllm_loss(on_mesh, models, batch)
    assert_matches(m_loss, m_grads, (None, loss, grads))
    assert_metrics_match(m_metrics, {k: float(v) for k, v in metrics.items()}, cfg.dpo.beta)


def byte_tokenizer():
    """transformers' tokenizer of jaxllm's byte vocabulary: each character its byte, the end-of-text 256."""
    from tokenizers import Regex, Tokenizer, models as tk_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(256)} | {"<|endoftext|>": EOT}
    tk = Tokenizer(tk_models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def trl_loss(models, rows: list[dict], loss: str, beta: float, gamma: float, out: str):
    """(loss, metrics, gradients by parameter name) of TRL's DPOTrainer (sigmoid, ipo) or CPOTrainer (simpo, with
    CPO's NLL term off) on the pairs, as one batch."""
    pytest.importorskip("trl")
    from datasets import Dataset

    policy, tok = H._load(models[1]), byte_tokenizer()
    common = {"output_dir": out, "beta": beta, "report_to": [], "per_device_train_batch_size": len(rows),
              "use_cpu": True, "bf16": False}
    if loss == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0.0, **common)
        trainer = CPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    else:
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=policy, ref_model=H._load(models[0]), args=DPOConfig(loss_type=[loss], **common),
                             train_dataset=Dataset.from_list(rows), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()  # as in training (the tiny model has no dropout), so the metrics land under "train"
    value = trainer.compute_loss(trainer.model, batch)
    value.backward()
    logged = trainer._stored_metrics["train"] if loss == "simpo" else trainer._metrics["train"]
    metrics = {k: float(np.mean(v)) for k, v in logged.items() if k.startswith(("rewards/", "logps/"))}
    return value.item(), metrics, {n: p.grad.numpy() for n, p in trainer.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_trl_computes_the_same_loss_metrics_and_gradients(models, tmp_path, loss):
    rows = pairs()
    cfg = config(models, write_pairs(tmp_path / "pairs.jsonl", rows), **LOSSES[loss])
    ours, metrics, grads = jaxllm_loss(cfg, models, batch_of(cfg), devices=1)
    d = cfg.dpo
    theirs, their_metrics, their_grads = trl_loss(models, rows, loss, d.beta, d.gamma, str(tmp_path / "trl"))
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
    assert sorted(their_metrics) == sorted(metrics)
    assert_metrics_match(metrics, their_metrics, cfg.dpo.beta)
    assert_grads_match(cfg, grads, their_grads)


# ---------------------------------------------------------------- the data: pairs in rows


def data_cfg(source: str, **over):
    return build_config(None, {"train.objective": "dpo", "data.format": "preference", "data.source": source,
                               "data.val_percent": 0, "model.seq_len": SEQ, "train.global_batch": ROWS, **over})


def rows_of(source: str, **over) -> dict:
    data = dataset.load(data_cfg(source, **over), BYTE)
    return packing.build(data.train, np.arange(len(data.train)))


def sequences(row: dict, i: int) -> list:
    """(tokens, learned targets, pair_id, side) of each segment of row i, the tokens from its inputs and last target."""
    out = []
    for s in range(1, row["segment_ids"][i].max() + 1):
        at = row["segment_ids"][i] == s
        tokens = list(row["inputs"][i, at]) + [row["targets"][i, at][-1]]
        out.append((tokens, row["loss_mask"][i, at], set(row["pair_id"][i, at]), set(row["side"][i, at])))
    return out


def test_a_pair_is_two_sequences_in_one_row_with_only_each_completion_learned(tmp_path):
    """Text pairs: each sequence is the prompt's bytes, the completion's, then the end-of-text; the targets
    learned are the completion's and the end-of-text (found from the strings here)."""
    rows = [{"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " five"},
            {"prompt": "hi", "chosen": "!", "rejected": "?!"}]
    built = rows_of(write_pairs(tmp_path / "p.jsonl", rows), **{"data.pack": True})
    seqs = sequences(built, 0)
    assert len(seqs) == 4  # both pairs packed into one row, each pair's sequences side by side
    for index, p in enumerate(rows):
        for side, key in enumerate(("chosen", "rejected")):
            tokens, learned, pair_id, sides = next(s for s in seqs if s[2] == {index} and s[3] == {side})
            assert tokens == list((p["prompt"] + p[key]).encode()) + [EOT]
            want = np.zeros(len(tokens) - 1)
            want[len(p["prompt"]) - 1:] = 1  # the target at position j is token j + 1
            assert np.array_equal(learned, want)


def test_message_pairs_are_rendered_by_the_chat_template(tmp_path):
    prompt = [{"role": "user", "content": "2+2?"}]
    rows = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}],
             "rejected": [{"role": "assistant", "content": "22"}]}]
    built = rows_of(write_pairs(tmp_path / "p.jsonl", rows))
    (c, c_learned, _, _), (r, r_learned, _, _) = sequences(built, 0)
    assert bytes(t for t in c if t < 256) == b"User: 2+2?\nAssistant: 4" and c[-1] == EOT
    assert bytes(t for t in r if t < 256) == b"User: 2+2?\nAssistant: 22"
    assert c_learned.sum() == 2 and r_learned.sum() == 3  # the reply and its end-of-text


@pytest.mark.parametrize("side, kept", [("left", "56789="), ("right", "012345")])
def test_length_limits_cut_the_prompt_at_its_side_and_the_completion_at_its_end(tmp_path, side, kept):
    rows = [{"prompt": "0123456789=", "chosen": "abcdef", "rejected": "xy"}]
    built = rows_of(write_pairs(tmp_path / "p.jsonl", rows), **{
        "data.max_prompt_tokens": 6, "data.max_completion_tokens": 3, "data.truncation_side": side})
    (c, c_learned, _, _), (r, _, _, _) = sequences(built, 0)
    assert c == list(f"{kept}abc".encode()) and r == list(f"{kept}xy".encode()) + [EOT]
    assert c_learned.sum() == 3


def test_a_pair_too_long_for_a_row_is_an_error_dropped_or_cut(tmp_path):
    long = {"prompt": "p" * 20, "chosen": "c" * 30, "rejected": "r" * 5}
    source = write_pairs(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, long])
    with pytest.raises(DataError, match=r"p.jsonl line 2: the pair's two sequences fill 50 \+ 25 positions"):
        dataset.load(data_cfg(source), BYTE)
    assert len(dataset.load(data_cfg(source, **{"data.truncation": "drop"}), BYTE).train) == 1
    built = rows_of(source, **{"data.truncation": "truncate"})
    (c, _, _, _), (r, _, _, _) = sequences(built, 1)
    assert len(c) - 1 + len(r) - 1 == SEQ and c == list(("p" * 20 + "c" * 20).encode())  # the chosen cut to fit
    hopeless = write_pairs(tmp_path / "q.jsonl", [long, {"prompt": "p" * 60, "chosen": "c", "rejected": "r"}])
    data = dataset.load(data_cfg(hopeless, **{"data.truncation": "truncate"}), BYTE)  # cut to fit, nothing learned
    assert len(data.train) == 1 and "1 truncated, 1 dropped" in data.description


@pytest.mark.parametrize("line, message", [
    ({"prompt": "a", "chosen": "b"}, "line 2: no 'rejected'"),
    ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]},
     "line 2: 'prompt' and 'rejected' must both be strings or both lists of messages"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, "line 2: the 'chosen' completion has no token to learn"),
    ("[1, 2]", "line 2: not a JSON object"),
])
def test_a_bad_line_is_one_error_naming_the_file_and_the_line(tmp_path, line, message):
    source = tmp_path / "p.jsonl"
    source.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                      + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    with pytest.raises(DataError, match=f"data.source {source} {message}"):
        dataset.load(data_cfg(str(source)), BYTE)


@pytest.mark.parametrize("over, message", [
    ({"data.format": "chat"}, 'train.objective="dpo" and data.format="preference" go together'),
    ({"dpo.loss": "hinge"}, "dpo.loss: 'hinge' is not one of sigmoid, ipo, simpo"),
    ({"dpo.loss": "ipo", "dpo.label_smoothing": 0.1}, "dpo.label_smoothing: the ipo loss has no label smoothing"),
    ({"dpo.gamma": 1.0}, "dpo.gamma: only the simpo loss has a target margin"),
    ({"dpo.beta": 0.0}, "dpo.beta: must be positive"),
    ({"data.truncation_side": "middle"}, "data.truncation_side: 'middle' is not one of left, right"),
    ({"model.mtp_depth": 1}, "model.mtp_depth=1 with train.objective=dpo: multi-token prediction trains with"),
])
def test_a_config_preference_optimisation_cannot_run_is_refused_in_one_line(tmp_path, over, message):
    from jaxllm.config import validate

    cfg = data_cfg(write_pairs(tmp_path / "p.jsonl"), **{"mesh.dp": 1, "model.vocab_size": 257, **over})
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, 1)


# ---------------------------------------------------------------- adapters, and the run


@pytest.mark.slow
def test_adapters_on_a_mesh_equal_one_device_and_their_reference_is_the_base(models, tmp_path):
    """LoRA (B drawn non-zero) on dp2 × fsdp2 × tp2 ZeRO-3 against one device; the reference the loop scores with
    (the policy with its adapters off) gives the base model's log-probabilities."""
    from jaxllm.models import lora
    from jaxllm.trainer.loop import reference_params

    keys = {"model.lora.rank": 4, "model.lora.targets": ["q", "v", "down"]}
    cfg = config(models, write_pairs(tmp_path / "pairs.jsonl"), **keys)
    batch = batch_of(cfg)
    results = []
    for c, devices in ((cfg, 1), (config(models, cfg.data.source, **keys, **MESHES["dp2_fsdp2_tp2_zero3"]), None)):
        fns = step_fns(c, devices)
        base = hf.load_params(models[0], lora.base_model(c.model), fns.base_shardings)
        params = jax.device_put(random_b(jax.device_get(fns.with_adapters(base))), fns.state_shardings.params)
        b = jax.device_put(batch, fns.batch_sharding)
        scored = {**b, "ref_logp": jax.block_until_ready(fns.token_logp(reference_params(c, fns)(params), b))}
        np.testing.assert_array_equal(np.asarray(scored["ref_logp"]), np.asarray(fns.token_logp(
            jax.device_put(lora.adapters_off(params), fns.state_shardings.params), b)))
        loss, metrics, grads = fns.loss_and_grads(params, scored)
        results.append((float(loss), jax.device_get(metrics), jax.device_get(grads)))
    (loss, metrics, grads), (m_loss, m_metrics, m_grads) = results
    assert metrics["rewards/margins"] != 0  # the adapters moved the policy off its base
    assert_matches(m_loss, m_grads, (None, loss, grads))
    assert_metrics_match(m_metrics, {k: float(v) for k, v in metrics.items()}, cfg.dpo.beta)


def random_b(params):
    """Every adapter's B drawn non-zero (fresh adapters start at B = 0, where the policy is its base)."""
    from jaxllm.models import lora

    rng = np.random.default_rng(0)
    return jax.tree.map(lambda n: n.replace(b=0.05 * rng.standard_normal(n.b.shape).astype(n.b.dtype))
                        if lora.is_node(n) else n, params, is_leaf=lora.is_node)


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_a_run_logs_the_rewards_validates_and_resumes_mid_epoch_bitwise(tmp_path):
    """DPO on adapters, 2 epochs of one pair per row on dp2 × fsdp4 (ZeRO-1): every step's row holds TRL's metrics
    (TensorBoard too), the validation row the held-out pairs'; a run stopped one step into its second epoch and
    resumed logs the same rows, bit for bit."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jaxllm.trainer.loop import train

    over = {"model.preset": "tiny-llama", "model.vocab_size": 257, "model.seq_len": 32, "model.lora.rank": 4,
            "train.objective": "dpo", "data.format": "preference", "data.val_percent": 20,
            "data.source": write_pairs(tmp_path / "pairs.jsonl", pairs(40)), "train.global_batch": 8,
            "train.epochs": 2, "train.checkpoint_every": 1, "train.keep_checkpoints": 20, "train.log_every": 1,
            "train.eval_every": 100, "train.lr": 1e-2, "train.warmup_steps": 1, "precision.compute": "float32",
            "run.sample_tokens": 0, "run.progress": False, "mesh.dp": 2, "mesh.fsdp": 4, "train.zero_stage": 1}
    full, part = tmp_path / "full", tmp_path / "part"
    train(build_config(None, {**over, "run.dir": str(full)}))
    ref = metric_rows(full)
    steps = [r for r in ref if "loss" in r]
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")
    assert all(set(names) <= set(r) for r in steps)
    assert steps[0]["rewards/margins"] == 0 and steps[-1]["rewards/margins"] > 0  # B starts at 0: the base
    assert steps[0]["rewards/accuracies"] == 0  # equal rewards: no chosen reward strictly above
    [val] = [r for r in ref if "val_loss" in r]
    assert {f"val_{k}" for k in names} <= set(val) and val["step"] == len(steps)
    events = EventAccumulator(str(full / "tensorboard"))
    events.Reload()
    assert {"rewards/accuracies", "val_rewards/accuracies"} <= set(events.Tags()["scalars"])
    per_epoch = len(steps) // 2
    shutil.copytree(full, part)
    for step in range(per_epoch + 2, 2 * per_epoch + 1):
        shutil.rmtree(part / "checkpoints" / str(step))
    train(build_config(None, {**over, "run.dir": str(part), "train.resume": True}))
    same = lambda rows: [unmeasured(r) for r in rows]
    assert same(metric_rows(part)) == same(ref)


def test_the_example_pairs_reject_the_models_own_mistake_and_the_control_swaps_half(tmp_path):
    from tools.examples import make_addition_pairs as m

    rng = np.random.default_rng(0)
    chat = {"messages": [{"role": "user", "content": "37+45"}, {"role": "assistant", "content": "82"}]}
    reply = lambda p, k: p[k][0]["content"]
    assert reply(m.pair(chat, rng, answer="81 "), "rejected") == "81"  # the model's own mistake
    misses = {reply(m.pair(chat, rng, answer="82"), "rejected") for _ in range(200)}  # right: a near miss
    assert misses == {"81", "83", "72", "92", "28"}
    assert reply(m.pair(chat, rng, swap=True, answer="81"), "chosen") == "81"
    m.write(tmp_path / "plain")
    m.write(tmp_path / "shuffled", shuffled=True)
    read = lambda name, split: [json.loads(line) for line in (tmp_path / name / split).read_text().splitlines()]
    plain, shuffled = read("plain", "train.jsonl"), read("shuffled", "train.jsonl")
    swapped = [a["chosen"] == b["rejected"] and a["rejected"] == b["chosen"] for a, b in zip(plain, shuffled)]
    assert all(s or a == b for s, a, b in zip(swapped, plain, shuffled)) and 0.45 < np.mean(swapped) < 0.55
    assert read("plain", "heldout.jsonl") == read("shuffled", "heldout.jsonl")
