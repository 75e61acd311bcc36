"""Chat templates and the assistant's spans: which characters of a rendered conversation the model learns.

A template is Jinja text rendered as transformers' `apply_chat_template` renders it: jinja2's immutable
sandbox with `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` that does not escape HTML,
`raise_exception`, `strftime_now`, and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...)
as variables. Where it comes from (`data.chat_template`): an `hf:DIR` tokenizer's own (chat_template.jinja,
else tokenizer_config.json's `chat_template`), the built-in template below (the byte and GPT-2
tokenizers, whose end of turn is their end-of-text token), or a `.jinja` file.

The assistant's spans, each reply through its end-of-turn token:
- from `{% generation %}...{% endgeneration %}` tags where the template has them (as transformers'
  `return_assistant_tokens_mask`);
- else by difference (MaxText's method): the conversation rendered up to an assistant turn with the
  generation prompt must be a prefix of the conversation rendered through that turn, which must be a prefix
  of the whole; the characters between are the reply, without the whitespace the template puts after
  its end-of-turn token. A template for which this does not hold is refused.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from jaxllm.data.tokenizers import EOT_TEXT
from jaxllm.errors import DataError

# The byte and GPT-2 tokenizers' template: plain labels, and the tokenizer's end-of-text ends each reply.
BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")
_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # where it came from, for messages
    variables: tuple  # (name, value) pairs the template sees besides messages and add_generation_prompt

    @property
    def tagged(self) -> bool:
        return bool(_TAG.search(self.text))


def load_template(spec: str, tokenizer, kwargs: dict | None = None) -> ChatTemplate:
    """`data.chat_template`: "" (the tokenizer's own, or the built-in one for byte and GPT-2), "builtin",
    or the path of a .jinja file; `kwargs` (`data.chat_template_kwargs`) are variables it sees besides the
    tokenizer's special tokens, as transformers passes them (they win over a special token of the same name)."""
    own = getattr(tokenizer, "chat_template", None)  # only an hf:DIR tokenizer has one
    hf = hasattr(tokenizer, "special_texts")
    # byte and GPT-2: the end-of-text token is written as tiktoken writes it, and read back as its id
    specials = tuple(sorted(tokenizer.special_texts.items())) if hf else (("bos_token", EOT_TEXT),
                                                                            ("eos_token", EOT_TEXT))
    taken = {"messages", "add_generation_prompt"} & set(kwargs or {})
    if taken:
        raise DataError(f"data.chat_template_kwargs: '{sorted(taken)[0]}' is the template's own variable; remove it")
    specials += tuple((kwargs or {}).items())
    if spec == "builtin" or (spec == "" and not hf):
        return ChatTemplate(BUILTIN_TEMPLATE, "the built-in template", specials)
    if spec == "":
        if not own:
            raise DataError(f"data.chat_template: the tokenizer {tokenizer.name} has no chat template (no "
                            "chat_template.jinja, none in tokenizer_config.json); set data.chat_template to a "
                            ".jinja file, or to 'builtin'")
        return ChatTemplate(own, f"{tokenizer.name}'s chat template", specials)
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"data.chat_template: no such file '{spec}'; give a .jinja file, 'builtin', or \"\" for "
                        "the tokenizer's own")
    return ChatTemplate(path.read_text(encoding="utf-8"), str(path), specials)


@functools.lru_cache(maxsize=8)
def _compiled(text: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: records where its output lands in the rendered text."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        @jinja2.pass_context
        def _mark(self, context, caller):
            out = caller()
            record = context.get("__spans")
            if record is not None:
                record.append((len("".join(context.get("__blocks"))), len(out)))
            return out

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(text)


def render(template: ChatTemplate, messages: list, add_generation_prompt: bool = False) -> tuple[str, list]:
    """(text, spans of the generation tags as (start, end) characters)."""
    import jinja2

    blocks: list[str] = []
    spans: list = []
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers drops None
    try:
        compiled = _compiled(template.text)
        context = dict(template.variables, messages=messages, add_generation_prompt=add_generation_prompt,
                       __blocks=blocks, __spans=spans)
        for block in compiled.generate(**context):
            blocks.append(block)
    except jinja2.TemplateError as e:
        raise DataError(f"data.chat_template ({template.source}): {' '.join(str(e).split())[:200]}; fix the "
                        "template or the conversation") from None
    return "".join(blocks), [(start, start + n) for start, n in spans]


def assistant_spans(template: ChatTemplate, messages: list) -> tuple[str, list]:
    """The rendered conversation and the (start, end) characters of each assistant reply, through its
    end-of-turn token: the template's generation tags, else the difference method (module docstring)."""
    text, tagged = render(template, messages)
    if template.tagged:
        return text, [s for s in tagged if s[1] > s[0]]
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, _ = render(template, messages[:i], add_generation_prompt=True)
        through, _ = render(template, messages[:i + 1])
        if before == render(template, messages[:i])[0] or not (through.startswith(before) and text.startswith(through)):
            raise DataError(f"data.chat_template ({template.source}): the assistant's reply cannot be found: the "
                            "template has no {% generation %} tags and rendering turn by turn does not extend the "
                            "text (or add_generation_prompt changes nothing); use a template with generation tags "
                            "(README: Supervised fine-tuning)")
        reply = through[len(before):].rstrip()
        spans.append((len(before), len(before) + len(reply)))
    return text, spans
