"""Requests as lm-evaluation-harness 0.4 builds them, from a task's documents to token ids.

- Few-shot examples: one `random.Random(1234)` per task, drawn in document order (`rnd.sample(pool, n)`; from the
  evaluated split itself, n+1 drawn and the document dropped), as its default sampler and seed do.
- Context: description + each example's text, target delimiter, answer and few-shot delimiter + the document's text.
- Multiple choice: one request per choice, (context, target delimiter + choice).
- A pair is encoded as its `_encode_pair` does: whitespace ending the context moved to the continuation, the whole
  string encoded, the context's ids split off by their count; an empty context is the tokenizer's BOS (else
  end-of-text) id. Scored over `(context + continuation)[-(L+1):]` (left truncation to the model's length L).
- Generation: the context's ids left-truncated to L − max_gen_toks, greedy, the new text decoded without special
  tokens and cut at the first of the stop strings (`until`, and the end-of-text token's text).
- Through a chat template (`Chat`): messages rendered with the generation prompt; the choice without delimiter.
- Rolling log-likelihood: the document's ids in disjoint windows of L predictions, each conditioned on the L ids
  before it (the first on BOS, else end-of-text), as its `get_rolling_token_windows` and `make_disjoint_window`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from jaxllm.data import chat as chat_lib
from jaxllm.errors import DataError

FEWSHOT_SEED = 1234  # lm-evaluation-harness's default fewshot_random_seed


def fewshot_examples(task, doc: dict, rnd: random.Random) -> list[dict]:
    n = task.num_fewshot
    if not n:
        return []
    pool = task.fewshot_docs
    if not task.same_split:
        return rnd.sample(pool, n)
    shots = [x for x in rnd.sample(pool, n + 1) if x != doc][:n]
    return shots if len(shots) == n else rnd.sample([x for x in pool if x != doc], n)


def answer(task, doc: dict) -> str:
    """A few-shot example's answer: the choice its target names, the first of several targets, or the target."""
    target = task.target(doc)
    if task.output_type == "multiple_choice" and isinstance(target, int):
        return task.choices(doc)[target]
    return target[0] if isinstance(target, list) else str(target)


def contexts(task, chat=None) -> list[str]:
    """Each document's context, in document order (the few-shot draws depend on the documents before); through
    `chat` (a `Chat`) where one is given."""
    rnd, out = random.Random(FEWSHOT_SEED), []
    for doc in task.docs:
        shots = fewshot_examples(task, doc, rnd)
        description = task.render("description", doc) if task.description else ""
        turns = "".join(f"{task.text(s)}{task.target_delimiter}{answer(task, s)}{task.fewshot_delimiter}"
                        for s in shots) + str(task.text(doc))
        out.append(description + turns if chat is None else chat.context(task, description, shots, doc, turns))
    return out


@dataclass(frozen=True)
class Chat:
    """Requests through a chat template, as lm-evaluation-harness's `apply_chat_template` builds them: the
    description as the system message; with `multiturn` each few-shot example a user turn (its text) and an
    assistant turn (its answer), else all of them and the document's text as one user message (the plain context
    without the description); then the generation prompt. A template that refuses the system role is rendered
    again without it."""
    template: object  # data.chat.ChatTemplate
    multiturn: bool = True

    def context(self, task, description: str, shots: list, doc: dict, turns: str) -> str:
        messages = [{"role": "system", "content": description}] if description else []
        if self.multiturn:
            for s in shots:
                messages += [{"role": "user", "content": str(task.text(s))},
                             {"role": "assistant", "content": answer(task, s)}]
            messages.append({"role": "user", "content": str(task.text(doc))})
        else:
            messages.append({"role": "user", "content": turns})
        try:
            return chat_lib.render(self.template, messages, add_generation_prompt=True)[0]
        except DataError:
            if not description:
                raise
            return chat_lib.render(self.template, messages[1:], add_generation_prompt=True)[0]


def choice_pairs(task, doc: dict, context: str, chat=None) -> list[tuple[str, str]]:
    """(context, continuation) per choice; through a chat template the choice follows the generation prompt
    with no delimiter."""
    delimiter = "" if chat is not None else task.target_delimiter
    return [(context, f"{delimiter}{c}") for c in task.choices(doc)]


def start_id(tokenizer) -> int:
    """What an empty context, and a rolling document's first window, is conditioned on: BOS, else end-of-text."""
    bos = getattr(tokenizer, "bos", None)
    return bos if bos is not None else tokenizer.eot


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    if not context:
        ids = [int(i) for i in tokenizer.encode(continuation)]
        ids = ids[1:] if getattr(tokenizer, "add_bos", False) and ids[:1] == [tokenizer.bos] else ids
        return [start_id(tokenizer)], ids
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = [int(i) for i in tokenizer.encode(context + continuation)]
    n = len(tokenizer.encode(context))
    return whole[:n], whole[n:]


def rolling_pairs(tokens: list[int], prefix: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) windows predicting every token once, each context at most max_len ids."""
    if not tokens:
        return []
    first = min(max_len, len(tokens))
    windows = [([prefix] + tokens[:first - 1], tokens[:first])]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_len)
        end = done + n
        windows.append((tokens[max(end - max_len - 1, 0):end - 1], tokens[end - n:end]))
        done += n
    return [(a[:len(a) - (len(b) - 1)], b) for a, b in windows]


def decode_new(tokenizer, ids) -> str:
    """Generated ids as text, special tokens left out (transformers' `skip_special_tokens=True`)."""
    ids = [int(i) for i in ids]
    if hasattr(tokenizer, "tok"):  # a Hugging Face tokenizer: its own rule for what is special
        return tokenizer.decode(ids, skip_special=True)
    return tokenizer.decode([i for i in ids if i not in tokenizer.stop_ids])


def cut_at_stops(text: str, until: list[str]) -> str:
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def stop_strings(task, tokenizer) -> list[str]:
    eos = tokenizer.decode([tokenizer.eot])
    return task.until + ([eos] if eos not in task.until else [])
