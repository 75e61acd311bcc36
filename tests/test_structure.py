"""The code base's shape, checked: imports point downward with no cycle (none hidden in a function),
functions in `jaxllm/trainer/` fit on a screen, building a step changes no global JAX setting, and
the config keys are a reviewed list."""

from __future__ import annotations

import ast
from pathlib import Path

import jax

from harness import equivalence_config
from jaxllm.config import to_dict
from jaxllm.schema import Config, table_keys

PACKAGE = Path(__file__).resolve().parents[1] / "jaxllm"
# Each layer may import only from the layers after it in this list (and its own).
LAYERS = ("trainer", "rl", "generate", "models", "parallel", "ops")
MAX_LINES = 80  # per function in jaxllm/trainer/


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


# The API's names are re-exported lazily, so that `import jaxllm` (and with it `jaxllm --help`) loads no JAX: the
# root package's `__getattr__` (PEP 562) imports the API when a name is first used, after every module has loaded.
# That import is no edge of the import graph.
LAZY_REEXPORTS = {"__getattr__"}


def _imports(source: str, modules: dict, lazy: frozenset = frozenset()) -> list[tuple[str, bool]]:
    """(imported jaxllm module, whether the import is inside a function) for every import in the source, those
    under `if TYPE_CHECKING:` included (a cycle hidden there is still one); imports inside a function named in
    `lazy` are left out."""
    tree, found = ast.parse(source), []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef) and child.name in lazy:
                continue
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            found.extend((n, local) for n in names if n in modules)
            visit(child, inner)

    visit(tree, False)
    return found


def _lazy(name: str) -> frozenset:
    """The functions of module `name` whose imports are lazy re-exports (the root package's alone)."""
    return frozenset(LAZY_REEXPORTS) if name == "jaxllm" else frozenset()


def _graph(include_local: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m, local in _imports(path.read_text(), modules, _lazy(name))
                   if m != name and (include_local or not local)}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (as a path that returns to its start), or None."""
    seen, done = [], set()

    def walk(node):
        if node in done:
            return None
        if node in seen:
            return seen[seen.index(node):] + [node]
        seen.append(node)
        for nxt in sorted(graph.get(node, ())):
            found = walk(nxt)
            if found:
                return found
        seen.pop()
        done.add(node)
        return None

    return next((c for c in map(walk, sorted(graph)) if c), None)


def test_the_import_graph_has_no_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_downward_and_none_hides_in_a_function():
    modules = _modules()
    layer = lambda name: next((l for l in LAYERS if name.startswith(f"jaxllm.{l}")), None)
    for name, path in modules.items():
        for target, local in _imports(path.read_text(), modules, _lazy(name)):
            if target == name:
                continue
            # the command line imports lazily, so `jaxllm --help` and a config error answer without loading JAX
            assert not local or name.split(".")[:2] == ["jaxllm", "cli"], f"{name} imports {target} inside a function"
            a, b = layer(name), layer(target)
            if a and b and a != b:
                assert LAYERS.index(a) < LAYERS.index(b), f"{name} ({a}) imports {target} ({b}), a layer above it"


def test_the_checkers_see_what_they_guard():
    """A cycle is found, and an import inside a function is seen as one (as the cycles this replaced were)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    source = "import jaxllm.ops\ndef f():\n    from jaxllm.parallel import expert_dispatch\n"
    assert _imports(source, _modules()) == [("jaxllm.ops", False), ("jaxllm.parallel", True),
                                            ("jaxllm.parallel.expert_dispatch", True)]
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jaxllm.config\n"
    assert _imports(typing_only, _modules()) == [("jaxllm.config", False)]


def test_functions_in_train_fit_on_a_screen():
    long = []
    for path in sorted((PACKAGE / "trainer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_building_an_fp32_step_leaves_the_global_matmul_precision_alone():
    """The fp32 step traces its matmuls at HIGHEST precision, and the process's setting is untouched.
    (Built here, not through the registry: building is what is tested; it is only lowered.)"""
    from jaxllm.config import validate
    from jaxllm.mesh import make_mesh
    from jaxllm.trainer.step import make_step_fns

    before = jax.config.jax_default_matmul_precision
    cfg = equivalence_config("tiny-gpt2")
    fns = make_step_fns(cfg, make_mesh(validate(cfg, 1)[0], cfg, devices=jax.devices()[:1]))
    text = fns.train_step.lower(fns.abstract_state, fns.abstract_batch(4, 32)).as_text()
    assert jax.config.jax_default_matmul_precision == before
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all("HIGHEST" in line for line in dots)


# Every config key. Adding or removing one is a change to this list, seen in review.
CONFIG_KEYS = """
data.chat_template data.chat_template_kwargs data.completion_key data.format data.loss_on data.messages_key data.pack data.prompt_key
data.source data.tokenizer data.truncation data.val_percent
data.chosen_key data.rejected_key data.max_prompt_tokens data.max_completion_tokens data.truncation_side
data.sources data.text_key data.document_mask data.add_bos data.add_eos data.prefetch
dpo.loss dpo.beta dpo.label_smoothing dpo.gamma
distributed.auto distributed.coordinator_address distributed.num_processes distributed.process_id
init.from_
mesh.dcn.dp mesh.dcn.ep mesh.dcn.fsdp mesh.dcn.pp mesh.dcn.sp mesh.dcn.tp
memory.offload_optimizer memory.offload_params
mesh.dp mesh.ep mesh.fsdp mesh.pp mesh.sp mesh.tp
model.attention_impl model.attn_bias model.collective_matmul model.cp_load_balance model.cp_strategy model.d_ff model.d_model
model.family model.head_dim model.init_std model.max_positions model.mlp model.mlp_bias
model.moe.balance_weight model.moe.capacity_factor model.moe.d_ff model.moe.n_experts model.moe.n_shared_experts
model.moe.shared_d_ff model.moe.shared_gate model.segments model.moe.bias_update_rate
model.moe.seq_balance_weight
model.moe.top_k model.moe.z_weight model.moe.score model.moe.norm_topk model.moe.routed_scale
model.moe.n_group model.moe.topk_group model.moe.router_bias
model.attention model.mla.q_lora_rank model.mla.kv_lora_rank model.mla.qk_nope_head_dim model.mla.qk_rope_head_dim
model.mla.v_head_dim model.rope_mscale_all_dim model.mtp_depth
model.lora.rank model.lora.alpha model.lora.rslora model.lora.targets model.lora.dropout model.lora.base_quant
model.lora.double_quant init.adapter
model.n_heads model.n_kv_heads model.n_layers model.norm model.norm_eps model.pattern model.positions
model.attn_softcap model.embed_scale model.final_softcap model.norm_offset model.norm_placement model.qk_norm
model.attn_sinks
model.mlp_limit model.attention_chunk model.rope_global model.attn_temperature_floor model.attn_temperature_scale
model.qk_l2_norm model.moe.router_logit_bias model.moe.expert_biases model.moe.gate_input
model.query_pre_attn_scalar model.rope_local_theta model.rope_attention_factor model.rope_beta_fast
model.rope_beta_slow model.rope_truncate
model.attn_output_gate model.rope_fraction model.linear_attn.num_k_heads model.linear_attn.num_v_heads
model.linear_attn.head_k_dim model.linear_attn.head_v_dim model.linear_attn.conv_kernel model.linear_attn.chunk
model.preset model.remat model.remat_group model.rope_factor model.rope_high_freq_factor model.rope_low_freq_factor
model.rope_original_context model.rope_scaling model.rope_theta model.seq_len model.sliding_window
model.tie_embeddings model.vocab_size model.window_pattern
precision.compute precision.fp8_exclude precision.grad_reduce precision.loss_scale precision.loss_scale_init precision.loss_scale_min
precision.loss_scale_window precision.matmul
rl.beta rl.epsilon rl.epsilon_high rl.format_pattern rl.group_size rl.loss rl.loss_norm rl.mask_truncated
rl.async_steps rl.behaviour_cap rl.max_num_gen_batches rl.overlong_buffer rl.overlong_factor rl.sampler rl.engine_slots
rl.engine_pages rl.engine_steps_per_call rl.max_new_tokens rl.num_iterations rl.prompt_suffix rl.rewards rl.scale_rewards rl.temperature
run.dir run.profile_steps run.progress run.sample_prompt run.sample_tokens run.wandb run.wandb_entity run.wandb_name
run.wandb_project run.wandb_tags
train.allreduce train.beta1 train.beta2 train.bucket_mb train.checkpoint_checksums train.checkpoint_every train.eps train.eval_batches train.eval_tasks train.eval_every train.global_batch
train.grad_clip train.keep_checkpoints train.log_every train.max_consecutive_skips train.skip_nonfinite
train.spike_factor train.spike_window train.loss_chunk train.mtp_weight train.lr train.microbatches
train.min_lr_ratio train.moment_dtype train.momentum train.objective train.optimizer train.pp_gather_once train.pp_schedule train.pp_virtual
train.epochs train.resume train.schedule_steps train.seed train.sequence_parallel train.steps train.warmup_ratio
train.warmup_steps train.weight_decay train.zero_stage train.zeropp.block train.zeropp.grads train.zeropp.hpz
train.zeropp.weights
""".split()


def _keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        nested = isinstance(v, dict) and f"{prefix}{k}" not in table_keys()
        out += _keys(v, f"{prefix}{k}.") if nested else [f"{prefix}{k}"]
    return out


def test_every_config_key_is_listed():
    keys = sorted(_keys(to_dict(Config())))
    assert keys == sorted(CONFIG_KEYS), {"new": sorted(set(keys) - set(CONFIG_KEYS)),
                                         "gone": sorted(set(CONFIG_KEYS) - set(keys))}
