"""The plan as text: `format_table` turns the dict `jaxllm.plan.plan` returns into the table `jaxllm plan` prints.

One function per section, in the order they print: the config, memory per device (compiled beside the
ZeRO theory), collectives, the ZeRO theory's stages, then remat, tensor parallelism, attention, the
pipeline, generation, a hand-built all-reduce, ZeRO++, fine-tuning and the program's matmuls where the
plan has them. Sizes are written by `jaxllm.plan.hlo.format_bytes`.
"""

from __future__ import annotations

from jaxllm.ops.attention import IMPLEMENTATIONS
from jaxllm.plan.hlo import KINDS, format_bytes


def format_table(p: dict) -> str:
    """The plan as a readable table: compiled memory beside the theory, collectives, all stages."""
    c, mem = p["config"], p["memory"]
    pl = p.get("pipeline", {})
    lines = _format_memory(p) + _format_flops(p) + _format_collectives(p) + _format_zero_theory(p)
    if "remat" in p:
        lines += _format_remat(p["remat"])
    if "tensor_parallel" in p:
        lines += _format_tensor_parallel(p["tensor_parallel"], mem["temp_bytes"])
    if "attention" in p:
        lines += _format_attention(p["attention"])
    if "attention_compiled" in p:
        lines += _format_attention_compiled(p["attention_compiled"])
    if pl.get("enabled"):
        lines += _format_pipeline(pl)
    if "generation" in p:
        lines += _format_generation(p["generation"], c["compute"])
    if "matmul_formats" in p:
        lines += _format_matmul_formats(p["matmul_formats"], p["config"]["compute"])
    if p.get("allreduce"):
        lines += _format_allreduce(p["allreduce"])
    if p.get("zeropp"):
        lines += _format_zeropp(p["zeropp"])
    if p.get("finetune"):
        lines += _format_finetune(p["finetune"])
    if p.get("matmuls"):
        lines += _format_matmuls(p["matmuls"])
    return "\n".join(lines)


def _format_memory(p: dict) -> list[str]:
    """The config's lines and memory per device: the compiled program's beside the ZeRO theory's."""
    c, mem, th = p["config"], p["memory"], p["theory"]
    stage = c["zero_stage"]
    mesh = " ".join(f"{a}={s}" for a, s in c["mesh"].items() if s > 1) or "1 device"
    preset = f"preset {c['preset']}, " if c["preset"] else ""
    lines = [
        f"plan: {preset}{c['family']} {c['n_layers']} layers, d_model={c['d_model']}, vocab={c['vocab_size']}; "
        f"Φ = {p['params']:,} parameters ({p['params'] / 1e6:.2f}M; {p['published_params']:,} without the vocabulary's "
        "padding rows, as transformers counts)",
        f"      mesh {mesh} over {p['devices']} {p['platform']} device(s)",
        f"      zero_stage={stage}, microbatches={c['microbatches']}, global_batch={c['global_batch']}, "
        f"seq_len={c['seq_len']}, compute={c['compute']}, optimizer={c['optimizer']}, remat={c['remat']}",
        "",
        f"memory per device          {'compiled':>12}   {'theory fp32':>12}   {'theory bf16 seeds':>17}",
    ]
    fp, bf = th["fp32"], th["bf16_seeds"]
    rows = [
        ("arguments", mem["argument_bytes"], f"{format_bytes(fp['argument_bytes'])}", ""),
        ("outputs", mem["output_bytes"], "", ""),
        ("aliased (donated)", mem["alias_bytes"], "", ""),
        ("temporaries", mem["temp_bytes"], _estimate(p.get("temporaries", {})), ""),
        ("total", mem["total_bytes"], format_bytes(fp["total_bytes"]), format_bytes(bf["total_bytes"])),
    ]
    for name, val, a, b in rows:
        lines.append(f"  {name:<24}{format_bytes(val):>12}   {a:>12}   {b:>17}")
    lines.append(f"  (total = arguments + outputs - aliased + temporaries; theory for stage {stage}: "
                 f"arguments {fp['argument_formula']}, total {fp['total_formula']}, seeds {bf['total_formula']})")
    pl = p.get("pipeline", {})
    if pl.get("enabled"):
        ps = pl["params"]
        lines.append(f"  (pp={pl['pp']}: a device holds one stage, so theory Φ = stack / pp + embedding/head/final "
                     f"norm (replicated over pp) = {ps['stack']:,} / {pl['pp']} + {ps['shared']:,} = {ps['stage']:,})")
    if fp["argument_bytes"]:
        lines.append(f"  compiled arguments / theory arguments = {mem['argument_bytes'] / fp['argument_bytes']:.3f}")
    lines += _format_temporaries(p.get("temporaries"), mem["temp_bytes"])
    loss = p["loss"]
    how = f"in chunks of {loss['chunk']} positions" if loss["chunk"] else "whole"
    lines.append(f"  loss: fp32 logits {format_bytes(loss['logit_bytes'])} per device and microbatch (as much again "
                 f"for their gradient), residual stream over the layers {format_bytes(loss['residual_bytes'])}: "
                 f"{how} (train.loss_chunk={loss['setting']}{', the rule' if loss['setting'] < 0 else ''})")
    return lines


def _estimate(tt: dict) -> str:
    return format_bytes(tt["total"]) if tt.get("total") else ""


def _format_temporaries(tt: dict | None, compiled: int) -> list[str]:
    """The temporaries estimate by part beside the compiled figure (`plan.temporaries`)."""
    if not tt:
        return []
    if tt["total"] is None:
        return [f"  temporaries estimate: {tt['note']}"]
    names = ("weights", "weights_moved", "activations", "forward_slot", "logits", "pipeline")
    parts = ", ".join(f"{n.replace('_', ' ')} {format_bytes(tt[n])}" for n in names if tt[n])
    how = " (the moved weights against the rest but the weights: the larger)" if tt["weights_moved"] else ""
    return [f"  temporaries estimate = {parts}{how}; compiled / estimate = {compiled / tt['total']:.3f}"]


def _format_flops(p: dict) -> list[str]:
    """The compiled matmul FLOPs beside the model's, and the roofline on a chip when asked."""
    f = p.get("flops")
    if not f:
        return []
    tera = lambda x: f"{x / 1e12:.4g} TFLOP"
    lines = ["", f"FLOPs per device per step: compiled matmuls {tera(f['compiled'])}, model {tera(f['model'])} "
                 f"(attention's causal half; {tera(f['model_full_attention'])} with its full S×S, as dense computes)",
             f"  compiled / model = HFU / MFU = {f['hfu_over_mfu']:.3f}"]
    if f.get("uncounted_calls"):
        lines.append(f"  not counted: {f['uncounted_calls']} kernel calls per step whose FLOPs the program does not "
                     "state (Pallas kernels), so compiled and the roofline's compute are lower bounds")
    if f.get("roofline"):
        r = f["roofline"]
        lines.append(f"  roofline on {r['chip']}: {r['step_s'] * 1e3:.2f} ms a step (compute {r['compute_s'] * 1e3:.2f} "
                     f"ms at {r['peak_flops'] / 1e12:.0f} TFLOP/s, memory {r['memory_s'] * 1e3:.2f} ms for "
                     f"{format_bytes(r['bytes'])} at {r['hbm_bytes_per_s'] / 1e12:.2f} TB/s)")
    return lines


def _format_collectives(p: dict) -> list[str]:
    """The compiled step's collectives per step by kind."""
    lines = ["", "collectives per step per device (loops counted per trip)", f"  {'kind':<20}{'count':>8}{'bytes':>14}"]
    for k in KINDS:
        v = p["collectives"][k]
        lines.append(f"  {k:<20}{v['count']:>8}{format_bytes(v['bytes']):>14}")
    if p.get("unknown_trip_loops"):
        lines.append(f"  ({p['unknown_trip_loops']} loop(s) without a known trip count were counted once)")
    return lines


def _format_zero_theory(p: dict) -> list[str]:
    """The ZeRO theory's four stages, this config's starred, and the state kept in host memory."""
    mem, th, pl = p["memory"], p["theory"], p.get("pipeline", {})
    stage, fp, bf = p["config"]["zero_stage"], th["fp32"], th["bf16_seeds"]
    held = [f"one of {pl['pp']} stages"] if pl.get("enabled") else []
    if pl["params"]["experts"] and pl["params"]["ep"] > 1:
        held.append(f"1/{pl['params']['ep']} of the experts")
    phi = f"Φ = {th['params']:,}" + (f" ({', '.join(held)})" if held else "")
    lines = ["", f"ZeRO theory per device, {phi}, N = fsdp = {th['fsdp']}",
             f"  {'stage':<7}{'fp32 total':>22}{'fp32 arguments':>26}{'bf16 seeds total':>26}"]
    for s in ("0", "1", "2", "3"):
        f32, b16 = fp["stages"][s], bf["stages"][s]
        mark = "*" if int(s) == stage else " "
        lines.append(f"  {mark}{s:<6}{f32['total_formula']:>11} {format_bytes(f32['total_bytes']):>10}"
                     f"{f32['argument_formula']:>15} {format_bytes(f32['argument_bytes']):>10}"
                     f"{b16['total_formula']:>15} {format_bytes(b16['total_bytes']):>10}")
    lines.append(f"  (* this config; assumes {th['assumes']})")
    if mem.get("host_bytes"):
        lines.append(f"  host memory (offloaded state, memory.*): {format_bytes(mem['host_bytes'])} per device, "
                     "counted in the arguments above")
    return lines


SEEDS_REMAT = [("none", "O(L): every activation", "1"), ("full", "O(L) layer inputs", "~1.33"),
               ("√L groups", "O(√L) group (and layer) inputs", "~1.33 to 1.67")]


def _format_remat(r: dict) -> list[str]:
    group = f"groups of {r['group']} of {r['repeats']} repeats per stage chunk" if r["group"] else "no groups"
    effect = (f", without groups {format_bytes(r['temp_bytes_without_group'])} "
              f"({r['temp_bytes'] / r['temp_bytes_without_group']:.2f}×)" if "temp_bytes_without_group" in r else "")
    lines = ["", f"activation recomputation: remat={r['remat']}, {group}; compiled temporaries "
             f"{format_bytes(r['temp_bytes'])}{effect} (python -m tools.studies.remat_table compares the settings)",
             f"  {'seeds':<12}{'activation memory':<34}{'compute':>14}"]
    return lines + [f"  {name:<12}{memory:<34}{compute:>14}" for name, memory, compute in SEEDS_REMAT]


def _format_tensor_parallel(tp: dict, temp_bytes: int) -> list[str]:
    """The "tensor parallelism" section of `format_table`."""
    n = tp["tp"]
    a, layers = tp["activation_bytes_per_layer"], tp["n_layers"]
    lines = ["", f"tensor parallelism (tp={n})"]
    if not tp["enabled"]:
        lines.append(f"  {tp['note']}: no tensor-parallel collectives")
    else:
        lines.append(f"  collectives per layer per device: b={tp['b']} rows × s={tp['s']} × d={tp['d']}, "
                     f"{tp['dtype_bytes']} bytes per element; size per call as XLA's result, sent = ring bytes "
                     "each device sends")
        lines.append(f"  {'setting':<31}{'pass':<10}{'count':>6}  {'kind':<20}{'size/call':>11}{'sent':>12}")
        for name, label in tp["settings"].items():
            mark = "*" if name == tp["setting"] else " "
            first = f"{mark}{name:<6}{label}"
            c = tp["collectives_per_layer"][name]
            for pas in ("forward", "backward"):
                for e in c[pas]:
                    lines.append(f"  {first:<31}{pas:<10}{e['count']:>6}  {e['kind']:<20}"
                                 f"{format_bytes(e['bytes_per_call']):>11}{format_bytes(e['sent_bytes']):>12}")
                    first, pas = "", ""
            sent = sum(v["sent_bytes"] for v in c["per_layer"].values())
            lines.append(f"  {'':<31}{'layer':<10}{sum(v['count'] for v in c['per_layer'].values()):>6}  "
                         f"{'':<20}{'':>11}{format_bytes(sent):>12}")
        reps = layers * tp["microbatches"]
        lines.append(f"  (* this config; per step × {layers} layers × {tp['microbatches']} microbatch(es) = × {reps}; "
                     "on CPU a reduce-scatter compiles to an all-reduce of the full array and a slice;")
        lines.append("   the embedding, the loss and parameter-gradient reductions are left out here, "
                     "counted in the step totals above)")
    sp_now = tp["setting"] != "tp"
    heads = ("without SP" + ("" if sp_now else "*"), "with SP" + ("*" if sp_now else ""))
    lines.append(f"  saved activations per device, no remat (estimate)  {heads[0]:>12}{heads[1]:>12}")
    labels = {"residual": "residual (2 norm inputs)", "region_inputs": "region inputs (2 gathered)",
              "qkv": "q, k, v", "attention_probs": "attention probabilities", "attention_out": "attention output",
              "mlp_hidden": "MLP hidden"}
    for k, v in a["terms"].items():
        lines.append(f"    {labels.get(k, k):<49}{format_bytes(v['without_sp']):>12}{format_bytes(v['with_sp']):>12}")
    total = tp["activation_bytes"]
    lines.append(f"    {'per layer':<49}{format_bytes(a['without_sp']):>12}{format_bytes(a['with_sp']):>12}")
    lines.append(f"    {f'× {layers} layers':<49}{format_bytes(total['without_sp']):>12}"
                 f"{format_bytes(total['with_sp']):>12}")
    lines.append(f"  sequence parallelism saves {format_bytes(total['sp_saving'])} "
                 f"({format_bytes(a['sp_saving'])} per layer); compiled temporaries of this program: "
                 f"{format_bytes(temp_bytes)} (gradients, logits and optimizer work included)")
    return lines


_ATTENTION_LABELS = {"probabilities": "probabilities", "score_gradients": "score gradients",
                     "block_scores": "block scores", "softmax_state": "softmax state",
                     "output_gradients": "output gradients", "kv_held": "K/V held", "qkv_out": "q/k/v/out"}


def _format_attention(at: dict) -> list[str]:
    """The "attention memory per layer" section of `format_table`."""
    sp, strategy = at["sp"], at["strategy"]
    terms = lambda x: ", ".join(f"{_ATTENTION_LABELS.get(k, k)} {format_bytes(v)}" for k, v in x["terms"].items())
    lines = ["", f"attention memory per layer (sp={sp}, {strategy})",
             f"  per device, estimate: b={at['b']} rows, seq_len={at['seq_len']}, {at['heads']} heads / "
             f"{at['kv_heads']} KV heads per tp rank, head_dim={at['head_dim']}, {at['dtype_bytes']} bytes per element",
             f"  {'sp=1 ' + at['baseline']:<24}{format_bytes(at['sp1']['bytes_per_layer']):>12}   {terms(at['sp1'])}"]
    if at["enabled"]:
        lines.append(f"  {f'sp={sp} {strategy}':<24}{format_bytes(at['this']['bytes_per_layer']):>12}   "
                     f"{terms(at['this'])}")
        others = ", ".join(f"{k} {v['ratio']:.4f}" + ("*" if k == strategy else "") if v else f"{k} n/a"
                           for k, v in at["strategies"].items())
        lines.append(f"  this / sp=1 = {at['ratio']:.4f} (1/sp = {1 / sp:.4f}); at sp={sp}: {others}")
    trend_strategy = strategy if at["enabled"] else next(iter(at["ratio_by_sp"]))
    trend = at["ratio_by_sp"].get(trend_strategy) or {}
    cells = ", ".join(f"sp={n} " + ("n/a" if r is None else f"{r:.4f}") for n, r in trend.items())
    refs = ", ".join(f"{1 / int(n):g}" for n in trend)
    lines.append(f"  this / sp=1 by sp at seq_len {at['seq_len']} ({trend_strategy}): {cells}   (1/sp: {refs})")
    return lines


def _format_attention_compiled(ac: dict) -> list[str]:
    """The compiled line under the attention section of `format_table`: one entry per implementation, the one this
    run uses starred (none with sp > 1: the islands run their own kernel)."""
    names = [k for k in IMPLEMENTATIONS if k in ac] + [k for k in ac if k not in IMPLEMENTATIONS and
                                                       k not in _ATTENTION_COMPILED_KEYS]
    star = lambda k: "*" if k == ac["chosen"] and ac["sp"] == 1 else ""
    cells = ", ".join(f"{k}{star(k)} " + ("n/a" if ac[k] is None else format_bytes(ac[k])) for k in names)
    sh = ac["shape"]
    mark = (f" (* this run: model.attention_impl={ac['setting']})" if ac["sp"] == 1 else "")
    lines = [f"  compiled, one layer's forward+backward: {cells}{mark}",
             f"    (temporaries of jax.grad of one attention call on one device: b={sh['b']}, seq_len={sh['seq_len']}, "
             f"{sh['heads']} heads / {sh['kv_heads']} KV heads, head_dim={sh['head_dim']}, {sh['dtype']})"]
    return lines + [f"    ({note})" for note in ac["notes"]]


_ATTENTION_COMPILED_KEYS = ("chosen", "setting", "sp", "shape", "notes", "seconds")


def _format_pipeline(pl: dict) -> list[str]:
    """The "pipeline" section of `format_table` (pp > 1 only)."""
    cp, bub = pl["collective_permute"], pl["bubble"]
    slots = pl["act_depth"] + pl["grad_depth"]
    lines = ["", f"pipeline (pp={pl['pp']}, {pl['schedule']}, v={pl['v']}, m={pl['m']})",
             f"  {pl['ticks']} ticks; bubble {bub['table']:.4f} from the table at unit costs (closed form "
             f"{bub['formula']:.4f}), {bub['model_costs']:.4f} at this model's per-layer costs "
             f"(F : R : B : W = {' : '.join(f'{c:.2f}' for c in bub['costs'])})",
             f"  buffers: {pl['act_depth']} stage input(s) kept + {pl['grad_depth']} gradient slot(s) = {slots} × "
             f"b={pl['b']} × s={pl['s']} × d={pl['d']} × {pl['dtype_bytes']} B ({pl['dtype']}) = "
             f"{format_bytes(pl['buffer_bytes'])} per device"]
    if "stash_depth" in pl:
        lines.append(f"  W stash: ({pl['stash_depth']} slots + the one B makes + its probes) × "
                     f"{format_bytes(pl['stash_slot_bytes'])} = {format_bytes(pl['stash_bytes'])} per device")
    lines.append(f"  collective-permutes per step       {'count':>6}{'size/call':>12}{'bytes':>12}")
    rows = [(f"table: 2 × {pl['ticks']} ticks, {pl['dtype']}", cp)]
    if "compiled" in cp:
        if cp["moved_dtype"] != pl["dtype"]:
            rows.append((f"table at {cp['moved_dtype']} (as moved)", cp["moved"]))
        c = cp["compiled"]
        rows.append(("compiled", {**c, "bytes_per_call": c["bytes"] // c["count"] if c["count"] else 0}))
    for label, v in rows:
        size, total = format_bytes(v["bytes_per_call"]), format_bytes(v["bytes"])
        lines.append(f"    {label:<33}{v['count']:>6}{size:>12}{total:>12}")
    if "compiled" in cp:
        types = ", ".join(cp["compiled_dtypes"]) or "none found"
        note = (f"the program moves {cp['moved_dtype']}, not {pl['dtype']} (XLA converts around each permute)"
                if cp["moved_dtype"] != pl["dtype"] else f"the program moves {cp['moved_dtype']}")
        lines.append(f"  (element type of the compiled permutes of one slot: {types}; {note}; "
                     "compiled counts every collective-permute of the step)")
    return lines


def _format_matmul_formats(f: dict, compute: str) -> list[str]:
    if not f["dense_layers"] or not f["groups"]:
        return []
    lines = ["", f"kept for the backward by the covered matmuls ({', '.join(f['groups'])}) of {f['dense_layers']} "
                 f"dense layers, {f['tokens']} tokens a device and microbatch, by precision.matmul (compute {compute}):"]
    for name, v in f["formats"].items():
        lines.append(f"  {name:<28}{format_bytes(v['input_bytes'] + v['weight_bytes']):>12}   inputs "
                     f"{format_bytes(v['input_bytes'])} at {v['x']:.3g} B, weights {format_bytes(v['weight_bytes'])} "
                     f"at {v['w']:.3g} B an element")
    if f["other_layers"]:
        lines.append(f"  ({f['other_layers']} expert or latent-attention layers not estimated)")
    return lines


def _format_generation(g: dict, compute: str) -> list[str]:
    return (["", f"generation per device (no compiling): {g['rows']} prompts of {g['prompt']} tokens + {g['new']} new, "
                 f"KV cache of {g['slots']} slots, {compute}",
             f"  {'weights as used (copy)':<28}{format_bytes(g['weights_copy_bytes']):>12}   transient: gathered over "
             "fsdp/pp at the program's start, freed at its end"]
            + _format_cache(g)
            + [f"  {'resharding received':<28}{format_bytes(g['reshard_bytes']):>12}   making that copy: at each "
               "generation call (the rollout engine: once per rollout)"
               + ("" if g["reshard_s"] is None else f"; ≥ {g['reshard_s'] * 1e6:,.1f} µs at the chip's interconnect")]
            + _format_engine_pool(g.get("engine_pool")))


def _format_engine_pool(pool: dict | None) -> list[str]:
    """The rollout engine's page pools (rl.sampler = engine), or nothing."""
    if pool is None:
        return []
    return [f"  {'rollout engine page pools':<28}{format_bytes(pool['bytes']):>12}   {pool['pages']:,} pages of "
            f"{pool['page']} tokens a data-parallel shard, {pool['slots']} slots (rl.engine_pages; 0: every slot's "
            "longest completion at once)"]


def _format_cache(g: dict) -> list[str]:
    """The cache's lines: without linear layers the KV cache alone, as before them; with them the attention
    layers' KV cache (per token), the linear layers' state (per row, whatever the length) and their total."""
    kv, linear = g["cache_per_token"], g.get("linear_state")
    per_token = f"per token per layer, before any split: {kv['formula']} values = {format_bytes(kv['bytes'])}"
    if linear is None:
        return [f"  {'KV cache':<28}{format_bytes(g['cache_bytes']):>12}   {per_token}"]
    lines = [] if not g["attention_layers"] else [
        f"  {'KV cache':<28}{format_bytes(g['kv_cache_bytes']):>12}   {_layers(g['attention_layers'], 'attention')}; "
        + per_token]
    return lines + [
        f"  {'linear state':<28}{format_bytes(linear['bytes']):>12}   {_layers(linear['layers'], 'linear')}; "
        f"per row per layer, before any split, constant in the length: {linear['per_row']['formula']} = "
        f"{format_bytes(linear['per_row']['bytes'])}",
        f"  {'cache, total':<28}{format_bytes(g['cache_bytes']):>12}   "
        + ("the KV cache and the linear state" if g["attention_layers"] else "the linear state: no attention layers")]


def _layers(n: int, kind: str) -> str:
    return f"{n} {kind} layer{'' if n == 1 else 's'}"


def _format_allreduce(a: dict) -> list[str]:
    return ["", f"gradient all-reduce: train.allreduce={a['algorithm']} over {a['devices']} devices, buckets of "
            f"{a['bucket_mb']} MB: {a['rounds']} collective-permute rounds per step",
            f"  bytes sent per device: compiled max {format_bytes(a['sent_max'])}, mean "
            f"{format_bytes(a['sent_mean'])}; formula {format_bytes(a['formula_bytes'])}; the seeds' all-reduce "
            f"2Φ = {format_bytes(a['seeds_bytes'])}"]


def _format_zeropp(z: dict) -> list[str]:
    on = ", ".join(n for n, k in (("qwZ", "weights"), ("qgZ", "grads"), ("hpZ", "hpz")) if z[k])
    ratio = lambda a, b: f"×{a / b:.3f}" if b else "-"
    return ["", f"ZeRO++ ({on}; blocks of {z['block']}; predicted ratio (1 + 4/{z['block']}) / "
            f"{z['compute']} bytes = {z['predicted_ratio']:.3f}), per device per step:",
            f"  all-gathers {format_bytes(z['gathers'])}; compiled without quantization "
            f"{format_bytes(z['gathers_unquantized'])}: {ratio(z['gathers'], z['gathers_unquantized'])}",
            f"  gradient all-to-alls {format_bytes(z['grad_all_to_all'])}; the same elements in {z['compute']} "
            f"{format_bytes(z['grad_unquantized'])}: {ratio(z['grad_all_to_all'], z['grad_unquantized'])}"]


def _format_finetune(f: dict) -> list[str]:
    lines = ["", "train state per device for fine-tuning (model.lora; from each one's abstract state, not compiled)",
             f"  {'':<12}{'frozen base':>14}{'(adapted)':>12}{'trained':>14}{'optimizer':>14}{'total':>14}"
             f"{'step arguments':>16}"]
    for name, v in f.items():
        if "refused" in v:
            lines.append(f"  {name:<12}refused: {v['refused']}")
            continue
        lines.append(f"  {name:<12}{format_bytes(v['base_bytes']):>14}{format_bytes(v['adapted_base_bytes']):>12}"
                     + "".join(f"{format_bytes(v[k]):>14}" for k in ("trained_bytes", "optimizer_bytes", "total_bytes"))
                     + f"{format_bytes(v['argument_bytes']):>16}")
    return lines


def _format_matmuls(matmuls: dict) -> list[str]:
    return ["", "matmuls in the compiled program by runner and operand types (a loop body counted once)"] + [
        f"  {k:<60}{v:>6}" for k, v in matmuls.items()]
