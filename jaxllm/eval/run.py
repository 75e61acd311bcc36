"""A task evaluated: its requests built, scored on the mesh, and its metrics; each request kept for inspection."""

from __future__ import annotations

from jaxllm.eval import metrics, requests, score


def evaluate(task, tokenizer, fns, params, seq: int, rows: int) -> tuple[dict, list[dict]]:
    """(the task's metrics, one record per document: its requests as strings and their log-likelihoods)."""
    if task.output_type == "multiple_choice":
        return _multiple_choice(task, tokenizer, fns, params, seq, rows)
    return _rolling(task, tokenizer, fns, params, seq, rows)


def _multiple_choice(task, tokenizer, fns, params, seq, rows):
    contexts = requests.contexts(task)
    per_doc = [requests.choice_pairs(task, doc, ctx) for doc, ctx in zip(task.docs, contexts)]
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
