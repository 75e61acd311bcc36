"""Fine-tuning examples from a JSONL file: each line one example, tokenized once, with the tokens it learns.

`data.format`:
- `chat`: `{"messages": [{"role": ..., "content": ...}, ...]}` (the key is `data.messages_key`), rendered
  by the chat template (`data/chat.py`); the assistant's replies are learned.
- `prompt_completion`: `{"prompt": ..., "completion": ...}` (`data.prompt_key`, `data.completion_key`), each
  a string or a list of messages. Strings: the text prompt + completion, then the end-of-text token;
  the completion and that token are learned. Messages: the chat template over prompt + completion; the
  completion's assistant replies are learned.

`data.loss_on = all` learns every token of the example instead. The rendered text is tokenized once and
each token is learned when it overlaps a learned character span, so a BPE merge across a turn boundary
cannot shift the mask. An example is `(ids, learn)`: `learn[j]` says token j is a target the loss counts
(never token 0, which nothing predicts). A line that is not such an example, or whose mask is empty,
is an error naming the file, the line and what is wrong.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import numpy as np

from jaxllm.data import chat
from jaxllm.errors import DataError

FORMATS = ("text", "chat", "prompt_completion", "preference")
LOSS_ON = ("assistant", "all")
TRUNCATION = ("error", "drop", "truncate")


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int32 [n]
    learn: np.ndarray  # bool [n]: token j is a target the loss counts
    line: int  # 1-based line of the source file
    key: str  # the raw line, for the train/validation split


def check_messages(value, where: str, what: str) -> list:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {what} must be a non-empty list of messages; fix the line")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {what} has a message without a string 'role' and 'content' ({str(m)[:60]}); "
                            "fix the line")
    return value


def _learned(starts: np.ndarray, ends: np.ndarray, spans: list) -> np.ndarray:
    """Tokens overlapping any span of characters."""
    learn = np.zeros(len(starts), bool)
    for a, b in spans:
        learn |= (starts < b) & (ends > a)
    return learn


def _chat_example(messages: list, first_learned: int, template, tokenizer) -> tuple:
    """(ids, learn) of a conversation; replies starting before character `first_learned` are not learned."""
    text, spans = chat.assistant_spans(template(), messages)
    ids, starts, ends = tokenizer.encode_chat(text)
    return ids, _learned(starts, ends, [s for s in spans if s[0] >= first_learned])


def _text_example(prompt: str, completion: str, tokenizer) -> tuple:
    """prompt + completion, tokenized together, then the end-of-text token (after the BOS an `hf:DIR`
    tokenizer adds); the completion's tokens and the end-of-text are learned."""
    ids, starts, ends = tokenizer.encode_chat(prompt + completion)
    learn = _learned(starts, ends, [(len(prompt), len(prompt) + len(completion))])
    bos = [tokenizer.bos] if getattr(tokenizer, "add_bos", False) else []
    return (np.concatenate([np.asarray(bos, np.int64), ids, [tokenizer.eot]]),
            np.concatenate([np.zeros(len(bos), bool), learn, [True]]))


def _fix(obj, d, otherwise: str) -> str:
    """What to do about a line without the prompt and completion keys: a chat line read as another format is the
    config's to fix, not the line's."""
    if isinstance(obj, dict) and d.messages_key in obj:
        return f"it is a chat line ('{d.messages_key}') read as data.format={d.format}: set data.format=chat"
    return otherwise


def parse_line(obj, where: str, d, template, tokenizer) -> tuple:
    """(ids, learn) of one JSON object, by `data.format`; `template()` gives the chat template."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: not a JSON object; each line must be one example")
    if d.format == "chat":
        if d.messages_key not in obj:
            raise DataError(f"{where}: no '{d.messages_key}' (data.messages_key); each line needs the list of messages")
        return _chat_example(check_messages(obj[d.messages_key], where, f"'{d.messages_key}'"), 0, template, tokenizer)
    missing = [k for k in (d.prompt_key, d.completion_key) if k not in obj]
    if missing:
        hint = _fix(obj, d, "")
        raise DataError(f"{where}: no {' or '.join(repr(k) for k in missing)} (data.prompt_key / data.completion_key)"
                        + (f"; {hint}" if hint else ""))
    return completion_example(obj[d.prompt_key], obj[d.completion_key], where, (d.prompt_key, d.completion_key),
                              template, tokenizer)


def completion_example(prompt, completion, where: str, keys: tuple, template, tokenizer) -> tuple:
    """(ids, learn) of a prompt and its completion, both strings (the completion learned, then the end-of-text)
    or both lists of messages (rendered by the chat template; the completion's assistant replies learned).
    `keys` name the two in errors."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return _text_example(prompt, completion, tokenizer)
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt = check_messages(prompt, where, f"'{keys[0]}'")
        completion = check_messages(completion, where, f"'{keys[1]}'")
        start = len(chat.render(template(), prompt, add_generation_prompt=True)[0])
        return _chat_example(prompt + completion, start, template, tokenizer)
    raise DataError(f"{where}: '{keys[0]}' and '{keys[1]}' must both be strings or both lists of messages; fix "
                    "the line")


def prompt_ids(prompt, template, tokenizer) -> np.ndarray:
    """A prompt as the model is to continue it: a string tokenized as it is (after the BOS an `hf:DIR`
    tokenizer adds), a list of messages (checked by the caller) rendered by the chat template with its
    generation prompt."""
    if isinstance(prompt, str):
        ids, _, _ = tokenizer.encode_chat(prompt)
        bos = [tokenizer.bos] if getattr(tokenizer, "add_bos", False) else []
        return np.concatenate([np.asarray(bos, np.int64), ids])
    ids, _, _ = tokenizer.encode_chat(chat.render(template(), prompt, add_generation_prompt=True)[0])
    return ids


def prompt_and_reply(obj, where: str, d, template, tokenizer) -> tuple[np.ndarray, str]:
    """A line as a generation request: (prompt ids, ending where the reply starts; the reply's text).
    chat: the messages before the last, which must be the assistant's, with the generation prompt;
    prompt_completion: the prompt, and the completion (a string, or one assistant message); preference: the
    prompt, and the chosen completion."""
    if d.format == "chat":
        messages = check_messages(obj.get(d.messages_key) if isinstance(obj, dict) else None, where, f"'{d.messages_key}'")
        prompt, reply = messages[:-1], messages[-1]
    else:
        reply_key = d.chosen_key if d.format == "preference" else d.completion_key
        if not isinstance(obj, dict) or d.prompt_key not in obj or reply_key not in obj:
            raise DataError(f"{where}: needs '{d.prompt_key}' and '{reply_key}'; {_fix(obj, d, 'fix the line')}")
        prompt, reply = obj[d.prompt_key], obj[reply_key]
        if isinstance(prompt, str) and isinstance(reply, str):
            return prompt_ids(prompt, template, tokenizer), reply
        prompt = check_messages(prompt, where, f"'{d.prompt_key}'")
        reply = check_messages(reply, where, f"'{reply_key}'")[-1]
    if reply["role"] != "assistant":
        raise DataError(f"{where}: the last message is the {reply['role']}'s, not the assistant's reply to compare")
    return prompt_ids(prompt, template, tokenizer), reply["content"]


def read_lines(path: str):
    """(where, line number, line, JSON object) for each non-blank line of a JSONL file; DataError for an unreadable one."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"data.source: cannot read '{path}' ({e.strerror}); give a JSONL file") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"data.source {path} line {number}"
            try:
                yield where, number, line.strip(), json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: not valid JSON ({e}); fix the line") from None


def read_examples(path: str, d, tokenizer, template) -> list[Example]:
    """Every line of a JSONL file as an Example (blank lines skipped); DataError for a bad line."""
    examples = []
    for where, number, line, obj in read_lines(path):
        ids, learn = parse_line(obj, where, d, template, tokenizer)
        if d.loss_on == "all":
            learn = np.ones(len(ids), bool)
        learn[:1] = False  # nothing predicts the first token
        if not learn.any():
            raise DataError(f"{where}: no token to learn (the {d.format} example has no assistant reply the "
                            "template marks); fix the line or the template")
        examples.append(Example(np.asarray(ids, np.int32), learn, number, line))
    if not examples:
        raise DataError(f"data.source: '{path}' holds no examples; give a JSONL file with one example per line")
    return examples


def fit(examples: list[Example], seq_len: int, truncation: str, source: str = "") -> tuple[list[Example], int, int]:
    """Examples that fit a row (n tokens make n-1 positions, so at most seq_len+1 tokens):
    (kept, truncated, dropped). `truncate` cuts the reply; an example with nothing left to learn is dropped."""
    kept, truncated, dropped = [], 0, 0
    for ex in examples:
        if len(ex.ids) <= seq_len + 1:
            kept.append(ex)
            continue
        if truncation == "error":
            raise DataError(f"data.source {source} line {ex.line}: {len(ex.ids)} tokens, more than model.seq_len+1 = "
                            f"{seq_len + 1}; raise model.seq_len, or set data.truncation to drop or truncate")
        cut = Example(ex.ids[:seq_len + 1], ex.learn[:seq_len + 1], ex.line, ex.key)
        if truncation == "truncate" and cut.learn.any():
            kept.append(cut)
            truncated += 1
        else:
            dropped += 1
    return kept, truncated, dropped


def split(examples: list[Example], val_percent: float) -> tuple[list[Example], list[Example]]:
    """(train, validation) by a hash of each line: the same on every machine, seed and process; at least one
    validation example when val_percent > 0 and there are two or more."""
    if val_percent == 0:
        return examples, []
    is_val = [zlib.crc32(ex.key.encode("utf-8")) % 10000 < val_percent * 100 for ex in examples]
    if not any(is_val) and len(examples) > 1:
        is_val[-1] = True
    val = [ex for ex, v in zip(examples, is_val) if v]
    train = [ex for ex, v in zip(examples, is_val) if not v]
    if not train:
        raise DataError(f"data.val_percent={val_percent} leaves no training example; lower it")
    return train, val
