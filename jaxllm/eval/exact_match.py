"""Greedy exact-match accuracy on held-out fine-tuning examples (`jaxllm exact-match`, `Model.exact_match`).

Each line of the file (the run's `data.format`: chat, prompt_completion or preference) is a request: the prompt
(for chat, every message before the last, with the template's generation prompt) and the reference reply (the
last message, the assistant's; a preference pair's chosen completion). The model generates greedily until a stop
id or `max_new_tokens`; a reply matches when its text equals the reference, both stripped of surrounding
whitespace.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

from jaxllm.data import chat
from jaxllm.data.examples import prompt_and_reply, read_lines
from jaxllm.errors import DataError
from jaxllm.generate import generate
from jaxllm.models import transformer
from jaxllm.trainer.loop import completion_text

log = logging.getLogger("jaxllm")


class Result(NamedTuple):
    matches: int
    prompts: list  # each request's prompt ids
    texts: list  # what the model generated
    replies: list  # the references

    @property
    def accuracy(self) -> float:
        return self.matches / len(self.prompts)


def requests(cfg, tokenizer, path: str, limit: int) -> tuple[list, list]:
    """(prompt ids, reference replies) of the file's lines, the first `limit` (0: all)."""
    d = cfg.data
    template = functools.cache(lambda: chat.load_template(d.chat_template, tokenizer, d.chat_template_kwargs))
    prompts, replies = [], []
    for where, _, _, obj in read_lines(path):
        ids, reply = prompt_and_reply(obj, where, cfg.data, template, tokenizer)
        prompts.append([int(i) for i in ids])
        replies.append(reply)
        if limit and len(prompts) == limit:
            break
    return prompts, replies


def accuracy(cfg, tokenizer, fns, params, prompts, replies, max_new_tokens: int, batch: int) -> tuple[int, list]:
    """(matches, generated texts), `batch` requests generated together."""
    room = transformer.max_positions(cfg.model) - max(len(p) for p in prompts)
    if room < 1:
        raise DataError(f"--data: a prompt of {max(len(p) for p in prompts)} tokens leaves no room in the model's "
                        f"{transformer.max_positions(cfg.model)} positions; shorten the prompts")
    if max_new_tokens > room:
        log.info("the longest prompt leaves room for %d new tokens (model.max_positions); generating that many", room)
        max_new_tokens = room
    texts = []
    for i in range(0, len(prompts), batch):
        done = generate(params, cfg, prompts[i:i + batch], max_new_tokens, on=fns, temperature=0.0,
                        stop_ids=tokenizer.stop_ids)
        texts += [completion_text(tokenizer, [], c.tokens) for c in done]
    return sum(t.strip() == r.strip() for t, r in zip(texts, replies)), texts


def run(cfg, tokenizer, fns, params, path: str, limit: int = 0, max_new_tokens: int = 32, batch: int = 64) -> Result:
    """The file's requests generated and compared."""
    prompts, replies = requests(cfg, tokenizer, path, limit)
    hits, texts = accuracy(cfg, tokenizer, fns, params, prompts, replies, max_new_tokens, batch)
    return Result(hits, prompts, texts, replies)
