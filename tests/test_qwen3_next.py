"""Qwen3-Next (`qwen3_next`) from a tiny random transformers checkpoint (hf_families' "qwen3_next": three Gated
DeltaNet layers to one gated attention layer, MoE with a gated shared expert and a dense layer): the first loss
of a run equals transformers' loss on the same batch, on one device and on fsdp2 × tp2 (the key-head groups and
the experts' hidden split over tp). Its logits (1e-4) and bitwise export round trip are test_hf_interop.py's,
its greedy generation test_generate_hf.py's, like every family's."""

import numpy as np
import pytest

import hf_families as H
from harness import eval_loss, step_fns
from jaxllm.interop import hf

pytestmark = pytest.mark.slow  # the fast tier imports Qwen3-Next in test_hf_interop.py
SEQ, ROWS = 32, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return H.build("qwen3_next", str(tmp_path_factory.mktemp("qwen3_next") / "model"))


def transformers_loss(path: str, windows: np.ndarray) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # labels shift inside: the loss of each window's SEQ next-token predictions
        return float(model(input_ids=torch.as_tensor(windows), labels=torch.as_tensor(windows)).loss)


@pytest.mark.parametrize("mesh", [{}, {"mesh.fsdp": 2, "mesh.tp": 2, "train.zero_stage": 3}])
def test_first_loss_equals_transformers(checkpoint, mesh):
    windows = H.sample_tokens(H.VOCAB_SIZE, ROWS, SEQ + 1, seed=3).astype(np.int64)
    cfg = hf.config_for(checkpoint, {"model.seq_len": SEQ, "train.global_batch": ROWS, "mesh.dp": 1,
                                     "precision.compute": "float32", **mesh})
    params = hf.load_params(checkpoint, cfg.model)
    total, count, _ = eval_loss(step_fns(cfg), params, windows)
    want = transformers_loss(checkpoint, windows)
    assert abs(float(total) / float(count) - want) <= 1e-5 * want


def _with_prediction_module(src: str, out: str) -> str:
    """`src` with Qwen3-Next's prediction module added as its files hold it (transformers does not read it): the
    norms of the embedding and the hidden state, the projection of the two joined, a block like the last layer's
    (full attention, MoE: its tensors perturbed) and a final norm, all `mtp.*`."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(f"{src}/model.safetensors")
    rng, last = np.random.default_rng(5), f"model.layers.{H.QWEN3_NEXT['num_hidden_layers'] - 1}."
    noise = lambda shape, std: (std * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    module = {"mtp.layers.0." + k[len(last):]: v + noise(v.shape, 0.05) for k, v in tensors.items()
              if k.startswith(last)}
    module |= {f"mtp.{n}.weight": noise((H.HIDDEN,), 0.3) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                     "norm")}
    module["mtp.fc.weight"] = noise((H.HIDDEN, 2 * H.HIDDEN), (2 * H.HIDDEN) ** -0.5)
    save_file({**tensors, **module}, f"{out}/model.safetensors", metadata={"format": "pt"})
    return out


def _transformers_logits(path: str, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' logits [b, s, vocab] of the inputs (windows[:, :-1]), and the prediction module's [b, s − 1,
    vocab] at positions 0 .. s − 2 (each predicting the token two ahead), in torch
    from transformers' own modules and the files' `mtp.*` tensors: vLLM's Qwen3NextMultiTokenPredictor, i.e.
    norm(layer(fc([norm_e(embed(next token)) | norm_h(hidden)]))) through the shared head."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as q

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    c, files = model.config, load_file(f"{path}/model.safetensors")
    get = lambda name: files[f"mtp.{name}"]  # noqa: E731
    norms = {n: q.Qwen3NextRMSNorm(c.hidden_size, c.rms_norm_eps) for n in ("pre_fc_norm_embedding",
                                                                             "pre_fc_norm_hidden", "norm")}
    for n, norm in norms.items():
        norm.load_state_dict({"weight": get(f"{n}.weight")})
    layer = q.Qwen3NextDecoderLayer(c, c.num_hidden_layers - 1).eval()
    block = {k[len("mtp.layers.0."):]: v for k, v in files.items() if k.startswith("mtp.layers.0.")}
    experts = range(c.num_experts)
    for part in ("gate_up_proj", "down_proj"):  # transformers holds the experts fused
        names = (["gate_proj", "up_proj"] if part == "gate_up_proj" else ["down_proj"])
        block[f"mlp.experts.{part}"] = torch.stack([torch.cat([block.pop(f"mlp.experts.{x}.{n}.weight") for n in names])
                                                    for x in experts])
    layer.load_state_dict(block)
    ids = torch.as_tensor(windows[:, :-1])
    hidden = {}
    model.model.layers[-1].register_forward_hook(lambda _m, _i, out: hidden.setdefault("h", out))
    with torch.no_grad():
        main = model(input_ids=ids).logits.numpy()
        e = norms["pre_fc_norm_embedding"](model.model.embed_tokens(ids[:, 1:]))
        z = torch.cat([e, norms["pre_fc_norm_hidden"](hidden["h"][:, :-1])], -1) @ get("fc.weight").T
        positions = torch.arange(z.shape[1])[None]
        mask = torch.full((z.shape[1], z.shape[1]), -torch.inf).triu(1)[None, None]
        z = layer(z, position_embeddings=model.model.rotary_emb(z, positions), attention_mask=mask,
                  position_ids=positions)
        return main, model.lm_head(norms["norm"](z)).numpy()


def test_the_prediction_module_imports_computes_as_published_and_exports_bitwise(checkpoint, tmp_path):
    """A checkpoint with the `mtp.*` module: imported as model.mtp_depth = 1, its loss term (`mtp_loss`) equals the
    module computed in torch from transformers' modules (1e-5), the main logits still transformers' (1e-4), and
    the export writes every tensor back bit for bit, the module's included."""
    import jax
    import jax.numpy as jnp

    from harness import loss_metrics_and_grads
    from jaxllm.models import transformer
    from test_hf_interop import assert_bitwise, file_tensors

    path = _with_prediction_module(checkpoint, str(tmp_path / "mtp"))
    windows = H.sample_tokens(H.VOCAB_SIZE, ROWS, SEQ + 1, seed=4).astype(np.int64)
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ, "train.global_batch": ROWS,
                                                      "mesh.dp": 1, "precision.compute": "float32"})
    assert cfg.model.mtp_depth == 1
    _, metrics, _ = loss_metrics_and_grads(step_fns(cfg), params, windows)
    main, logits = _transformers_logits(path, windows)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    want = -np.take_along_axis(logp, windows[:, 2:, None], -1).sum() / (ROWS * SEQ)  # over the LM's tokens
    assert abs(float(metrics["mtp_loss"]) - want) <= 1e-5 * want
    ours = jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(windows[:, :SEQ]))
    assert np.abs(np.asarray(ours) - main).max() <= 1e-4
    hf.save_pretrained(params, cfg, str(tmp_path / "out"), source=path)
    assert_bitwise(file_tensors(path), file_tensors(str(tmp_path / "out")))
