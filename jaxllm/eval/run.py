"""A task evaluated: its requests built, scored on the mesh, and its metrics; each request kept for inspection."""

from __future__ import annotations

from jaxllm.errors import DataError
from jaxllm.eval import metrics, requests, score
from jaxllm.generate import generate


def evaluate_all(tasks, tokenizer, fns, params, cfg, chat=None) -> tuple[dict, dict]:
    """`evaluate` for each task: ({task: its metrics}, {task: its records})."""
    results, samples = {}, {}
    for task in tasks:
        results[task.name], samples[task.name] = evaluate(task, tokenizer, fns, params, cfg, chat)
    return results, samples


def evaluate(task, tokenizer, fns, params, cfg, chat=None) -> tuple[dict, list[dict]]:
    """(the task's metrics, one record per document: its requests as strings and their log-likelihoods, or its
    generated text). Requests run `train.global_batch` at a time, at most `model.seq_len` tokens each; through
    `chat` (a `requests.Chat`) where given (rolling log-likelihood takes no context, so no template)."""
    seq, rows = cfg.model.seq_len, cfg.train.global_batch
    if task.output_type == "multiple_choice":
        return _multiple_choice(task, tokenizer, fns, params, seq, rows, chat)
    if task.output_type == "generate_until":
        return _generate_until(task, tokenizer, fns, params, cfg, chat)
    return _rolling(task, tokenizer, fns, params, seq, rows)


def _multiple_choice(task, tokenizer, fns, params, seq, rows, chat):
    contexts = requests.contexts(task, chat)
    per_doc = [requests.choice_pairs(task, doc, ctx, chat) for doc, ctx in zip(task.docs, contexts)]
    flat = [requests.encode_pair(tokenizer, c, x) for pairs in per_doc for c, x in pairs]
    lls, records, at = score.loglikelihoods(fns, params, flat, seq, rows), [], 0
    sums = dict.fromkeys(task.metrics, 0.0)
    for doc, pairs in zip(task.docs, per_doc):
        mine, at = lls[at:at + len(pairs)], at + len(pairs)
        scores = metrics.choice_scores(mine, task.choices(doc), task.target(doc))
        for m in task.metrics:
            sums[m] += scores[m]
        records.append({"arguments": pairs, "loglikelihoods": mine, **scores})
    return {m: v / len(task.docs) for m, v in sums.items()}, records


def _rolling(task, tokenizer, fns, params, seq, rows):
    texts = [str(task.target(doc)) for doc in task.docs]
    windows = [requests.rolling_pairs([int(i) for i in tokenizer.encode(t)], requests.start_id(tokenizer), seq)
               for t in texts]
    flat = [w for ws in windows for w in ws]
    lls, per_doc, at = score.loglikelihoods(fns, params, flat, seq, rows), [], 0
    for ws in windows:
        per_doc.append(sum(lls[at:at + len(ws)]))
        at += len(ws)
    scores = metrics.rolling_scores(per_doc, texts)
    records = [{"arguments": [(t,)], "loglikelihoods": [ll]} for t, ll in zip(texts, per_doc)]
    return {m: scores[m] for m in task.metrics}, records


def _generate_until(task, tokenizer, fns, params, cfg, chat):
    """Greedy completions of each context, `rows` prompts at a time, then the filters and exact match."""
    contexts = requests.contexts(task, chat)
    seq, rows = cfg.model.seq_len, cfg.train.global_batch
    keep = seq - task.max_gen_toks
    if keep < 1:
        raise DataError(f"task {task.name}: max_gen_toks={task.max_gen_toks} leaves no room for a context in "
                        f"model.seq_len={seq}; lower max_gen_toks")
    prompts = [[int(i) for i in tokenizer.encode(c)][-keep:] for c in contexts]
    until, texts = requests.stop_strings(task, tokenizer), []
    for start in range(0, len(prompts), rows):
        done = generate(params, cfg, prompts[start:start + rows], task.max_gen_toks, on=fns, temperature=0.0,
                        stop_ids=tokenizer.stop_ids)
        texts += [requests.cut_at_stops(requests.decode_new(tokenizer, c.tokens), until) for c in done]
    sums, records = {}, []
    for doc, context, text in zip(task.docs, contexts, texts):
        gold = task.target(doc)
        gold = str(task.choices(doc)[gold] if "doc_to_choice" in task.spec else gold)
        record = {"arguments": [[context, until]], "generated": text}
        for name, steps in task.filters.items():
            answer = metrics.apply_filter(steps, text)
            for metric in task.metrics:
                key = metric if name == "none" else f"{metric}/{name}"
                record[key] = metrics.exact_match(answer, gold, **task.metric_args.get(metric, {}))
                sums[key] = sums.get(key, 0.0) + record[key]
            record[f"filtered/{name}"] = answer
        records.append(record)
    return {k: v / len(task.docs) for k, v in sums.items()}, records
