"""Greedy exact-match accuracy of a model on held-out fine-tuning examples.

    jaxllm exact-match --from runs/sft --data heldout.jsonl [--limit 200] [--step N] [key=value ...]

Each line of `--data` (the run's `data.format`: chat, prompt_completion or preference) is a request: the
prompt (for chat, every message before the last, with the template's generation prompt) and the reference
reply (the last message, the assistant's; a preference pair's chosen completion). The model generates
greedily, on the run's mesh, until a stop id or `--max-new-tokens`; a reply matches when its text equals the
reference, both stripped of surrounding whitespace. `--step 0` measures the run's starting parameters (its init.from, or its seed's random
ones): accuracy before fine-tuning. Prints `exact_match K/N = P%`; a problem is one line, exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys

import numpy as np

from jaxllm import cli

log = logging.getLogger("jaxllm")


def parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="jaxllm exact-match", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", required=True, help="a run directory or hf:DIR")
    p.add_argument("--data", required=True, help="a JSONL file of held-out examples")
    p.add_argument("--limit", type=int, default=0, help="the first N examples only (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=64, help="requests generated together")
    p.add_argument("--step", type=int, default=None, help="a checkpoint step; 0: the starting parameters")
    p.add_argument("overrides", nargs="*", help="run keys, e.g. mesh.tp=2 data.format=chat")
    return p


def requests(cfg, tokenizer, path: str, limit: int) -> tuple[list, list]:
    """(prompt ids, reference replies) of the file's lines."""
    from jaxllm.data import chat
    from jaxllm.data.examples import prompt_and_reply, read_lines

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
    """(matches, generated texts)."""
    from jaxllm.errors import DataError
    from jaxllm.generate import generate
    from jaxllm.models import transformer
    from jaxllm.train.loop import completion_text

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


def run(args) -> None:
    from jaxllm.cli.generate import load

    cfg, tokenizer, fns, params = load(args.source, args.step, args.overrides)
    prompts, replies = requests(cfg, tokenizer, args.data, args.limit)
    hits, texts = accuracy(cfg, tokenizer, fns, params, prompts, replies, args.max_new_tokens, args.batch)
    for prompt, text, reply in list(zip(prompts, texts, replies))[:3]:
        log.info("e.g. %r -> %r (reference %r)", tokenizer.decode(np.asarray(prompt, np.uint32)), text, reply)
    print(f"exact_match {hits}/{len(prompts)} = {100 * hits / len(prompts):.1f}%")


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_with_overrides(parser(), argv)
    return cli.run(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
