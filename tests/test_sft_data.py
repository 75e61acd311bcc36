"""Fine-tuning data without a model: chat templates rendered as transformers renders them, the assistant
mask from generation tags and from the difference method against transformers' own, prompt/completion
lines, bad lines, truncation, packing, epochs and the validation split."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import chex
import numpy as np
import pytest

from jaxllm.config import build_config
from jaxllm.data import chat, dataset, packing
from jaxllm.data.examples import Example, read_examples
from jaxllm.data.tokenizers import EOT_TEXT, get_tokenizer
from jaxllm.errors import DataError, UserError

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"
BYTE = get_tokenizer("byte")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "},
     {"role": "assistant", "content": "Hello!\nHow can I help?"}, {"role": "user", "content": "Count: 1 2 3"},
     {"role": "assistant", "content": " 4 5 6 "}],
    [{"role": "user", "content": "Ünïcode — ok?"}, {"role": "assistant", "content": "ja, ça va 👍"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "again"}],
]


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def data_config(**over):
    return build_config(None, {"data.format": "chat", **{f"data.{k}": v for k, v in over.items()}}).data


def examples_of(path: str, tokenizer=BYTE, **over) -> list[Example]:
    d = data_config(**over)
    return read_examples(path, d, tokenizer, lambda: chat.load_template(d.chat_template, tokenizer,
                                                                                 d.chat_template_kwargs))


# ---------------------------------------------------------------- the built-in template and its mask


def test_builtin_template_learns_exactly_each_reply_and_its_end_of_text(tmp_path):
    """Byte tokens: the learned tokens are the reply bytes and the end-of-text id after each, found here by
    searching the rendered text, not by the code under test."""
    [ex] = examples_of(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}]))
    text = chat.render(chat.load_template("", BYTE), CONVERSATIONS[1])[0]
    assert text.count(EOT_TEXT) == 2
    want = np.zeros(len(ex.ids), bool)
    raw = text.encode()
    for reply in ("Hello!\nHow can I help?", " 4 5 6 "):
        start = raw.index(("Assistant: " + reply).encode()) + len("Assistant: ")
        first = start - raw[:start].count(EOT_TEXT.encode()) * (len(EOT_TEXT) - 1)  # each EOT is one token
        n = len(reply.encode())
        want[first:first + n + 1] = True
    assert ex.ids[want][-1] == BYTE.eot and (ex.ids == BYTE.eot).sum() == 2
    assert np.array_equal(ex.learn, want)


def test_loss_on_all_learns_every_token_but_the_first(tmp_path):
    [ex] = examples_of(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}]), loss_on="all")
    assert not ex.learn[0] and ex.learn[1:].all()


# ---------------------------------------------------------------- Hugging Face templates against transformers


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """The LLaMA-3-style test tokenizer with ChatML's special tokens added and Qwen2's template."""
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path_factory.mktemp("chatml")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(FIXTURES / "hf_tokenizer" / f, folder / f)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "chatml.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _folders(chatml_tokenizer):
    return {"chatml": chatml_tokenizer, "llama3": FIXTURES / "hf_tokenizer"}


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_templates_render_and_mask_as_transformers(family, chatml_tokenizer, tmp_path):
    """Byte-for-byte the text transformers renders (with and without the generation prompt); the difference
    method's mask on the untagged template, and the tags' mask on the tagged twin, both equal transformers'
    return_assistant_tokens_mask on the tagged twin, token for token."""
    from transformers import AutoTokenizer

    folder = _folders(chatml_tokenizer)[family]
    theirs = AutoTokenizer.from_pretrained(str(folder))
    ours = get_tokenizer(f"hf:{folder}")
    tagged_text = (TEMPLATES / f"{family}_tagged.jinja").read_text()
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    untagged = examples_of(path, ours, chat_template=str(TEMPLATES / f"{family}.jinja"))
    tagged = examples_of(path, ours, chat_template=str(TEMPLATES / f"{family}_tagged.jinja"))
    for conv, a, b in zip(CONVERSATIONS, untagged, tagged):
        for name in (f"{family}.jinja", f"{family}_tagged.jinja"):
            text = (TEMPLATES / name).read_text()
            for gen in (False, True):
                want = theirs.apply_chat_template(conv, chat_template=text, tokenize=False, add_generation_prompt=gen)
                assert chat.render(chat.load_template(str(TEMPLATES / name), ours), conv, gen)[0] == want
        out = theirs.apply_chat_template(conv, chat_template=tagged_text, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        assert a.ids.tolist() == list(out["input_ids"]) == b.ids.tolist()
        mask = np.asarray(out["assistant_masks"], bool)
        assert mask.sum() > 0 and np.array_equal(a.learn, mask) and np.array_equal(b.learn, mask)


# Gemma's and Qwen3's templates, written here to render what those families' published templates render (there is
# no downloading here): Gemma's turns (`model` for the assistant, the system text put before the first user
# message, replies trimmed), Qwen3's empty think block on the last reply and none on earlier ones, and its
# `enable_thinking = false` generation prompt.
def with_tokens(src: Path, folder: Path, tokens: list[str], template: str) -> Path:
    """A copy of tokenizer folder `src` with `tokens` added as special tokens and `template` as its own."""
    from tokenizers import AddedToken, Tokenizer

    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / f, folder / f)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    return folder


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory, chatml_tokenizer):
    return {"gemma": with_tokens(FIXTURES / "hf_tokenizer", tmp_path_factory.mktemp("gemma"),
                                 ["<start_of_turn>", "<end_of_turn>"], "gemma.jinja"),
            "qwen3": with_tokens(chatml_tokenizer, tmp_path_factory.mktemp("qwen3"), ["<think>", "</think>"],
                                 "qwen3.jinja")}


ONE_TURN = [c for c in CONVERSATIONS if sum(m["role"] == "assistant" for m in c) == 1]


@pytest.mark.parametrize("family", ["gemma", "qwen3"])
def test_gemma_and_qwen3_templates_render_and_mask_as_transformers(family, family_tokenizers, tmp_path):
    """Byte for byte what transformers renders, with the generation prompt or without and (Qwen3) with
    enable_thinking unset, true or false passed to both; the difference method's mask on the template and the
    tags' on its tagged twin equal transformers' return_assistant_tokens_mask (Qwen3: one-turn chats, see
    the next test)."""
    from transformers import AutoTokenizer

    folder = family_tokenizers[family]
    theirs, ours = AutoTokenizer.from_pretrained(str(folder)), get_tokenizer(f"hf:{folder}")
    chats = CONVERSATIONS if family == "gemma" else ONE_TURN
    kwargs_cases = [{}] if family == "gemma" else [{}, {"enable_thinking": True}, {"enable_thinking": False}]
    for conv in chats:
        for kwargs in kwargs_cases:
            for gen in (False, True):
                want = theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **kwargs)
                assert chat.render(chat.load_template("", ours, kwargs), conv, gen)[0] == want
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats])
    tagged_name = str(TEMPLATES / f"{family}_tagged.jinja")
    for a, b, conv in zip(examples_of(path, ours), examples_of(path, ours, chat_template=tagged_name), chats):
        out = theirs.apply_chat_template(conv, chat_template=(TEMPLATES / f"{family}_tagged.jinja").read_text(),
                                         tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        mask = np.asarray(out["assistant_masks"], bool)
        assert a.ids.tolist() == list(out["input_ids"]) == b.ids.tolist()
        assert mask.sum() > 0 and np.array_equal(a.learn, mask) and np.array_equal(b.learn, mask)


def test_qwen3_two_turns_are_refused_untagged_and_enable_thinking_false_learns_the_reply(family_tokenizers, tmp_path):
    """Qwen3 renders an earlier reply without the think block it gives the last one, so the conversation through
    turn 1 is not a prefix of the whole: the difference method refuses it in one line (its tagged twin takes
    it). With enable_thinking = false the generation prompt holds the empty think block, so the learned tokens
    are the reply and its <|im_end|> alone."""
    ours = get_tokenizer(f"hf:{family_tokenizers['qwen3']}")
    two = write_jsonl(tmp_path / "two.jsonl", [{"messages": CONVERSATIONS[2]}])
    with pytest.raises(DataError, match="reply cannot be found") as e:
        examples_of(two, ours)
    assert "\n" not in str(e.value)
    assert len(examples_of(two, ours, chat_template=str(TEMPLATES / "qwen3_tagged.jinja"))) == 1
    [ex] = examples_of(write_jsonl(tmp_path / "one.jsonl", [{"messages": CONVERSATIONS[0]}]), ours,
                       chat_template_kwargs={"enable_thinking": False})
    assert ours.decode(ex.ids[ex.learn]) == "4<|im_end|>"
    [thinking] = examples_of(write_jsonl(tmp_path / "t.jsonl", [{"messages": CONVERSATIONS[0]}]), ours)
    assert ours.decode(thinking.ids[thinking.learn]) == "<think>\n\n</think>\n\n4<|im_end|>"


def test_a_template_neither_tagged_nor_extendable_is_refused(tmp_path, chatml_tokenizer):
    ours = get_tokenizer(f"hf:{chatml_tokenizer}")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}])
    with pytest.raises(DataError, match="reply cannot be found") as e:
        examples_of(path, ours, chat_template=str(TEMPLATES / "unmarkable.jinja"))
    assert "\n" not in str(e.value)


def test_a_tokenizer_without_a_template_is_refused():
    no_template = get_tokenizer(f"hf:{FIXTURES / 'hf_tokenizer_gpt2'}")
    with pytest.raises(DataError, match="has no chat template"):
        chat.load_template("", no_template)
    assert chat.load_template("builtin", no_template).text == chat.BUILTIN_TEMPLATE


# ---------------------------------------------------------------- prompt/completion and bad lines


def test_prompt_completion_strings_and_messages(tmp_path):
    """Strings: prompt + completion + end-of-text, the completion and end-of-text learned; custom keys.
    Messages: only the completion's replies are learned, not an assistant turn inside the prompt."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "2+3=", "answer": "5"}])
    [ex] = examples_of(path, format="prompt_completion", prompt_key="question", completion_key="answer")
    assert BYTE.decode(ex.ids[:-1]) == "2+3=5" and ex.ids[-1] == BYTE.eot
    assert ex.learn.tolist() == [False] * 4 + [True, True]
    conv = CONVERSATIONS[1]
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": conv[:4], "completion": conv[4:]}])
    [ex] = examples_of(path, format="prompt_completion")
    learned = BYTE.decode(ex.ids[ex.learn])
    assert learned == " 4 5 6 " + EOT_TEXT


@pytest.mark.parametrize("line, problem", [
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('{"msgs": []}', "no 'messages'"),
    ('{"messages": "hi"}', "non-empty list of messages"),
    ('{"messages": [{"role": "user"}]}', "without a string 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no token to learn"),
    ('[1, 2]', "not a JSON object"),
])
def test_a_bad_line_is_one_error_naming_it(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATIONS[0]}, line])
    with pytest.raises(DataError, match=problem) as e:
        examples_of(path)
    assert "line 2" in str(e.value) and "\n" not in str(e.value)


def test_prompt_completion_lines_need_both_keys_of_one_kind(tmp_path):
    for row, problem in (({"prompt": "a"}, "no 'completion'"),
                         ({"prompt": "a", "completion": []}, "must both be strings"),
                         ({"messages": CONVERSATIONS[0]}, "a chat line .* read as data.format=prompt_completion: set "
                                                          "data.format=chat")):
        with pytest.raises(DataError, match=problem):
            examples_of(write_jsonl(tmp_path / "p.jsonl", [row]), format="prompt_completion")


def test_a_chat_line_asked_as_a_prompt_completion_request_names_the_format():
    """exact-match's requests (`prompt_and_reply`) from a chat file on a model whose format defaults to
    prompt_completion: the fix is the config's, not the line's."""
    from jaxllm.data.examples import prompt_and_reply

    with pytest.raises(DataError, match="line 1: needs 'prompt' and 'completion'; it is a chat line"):
        prompt_and_reply({"messages": CONVERSATIONS[0]}, "line 1", data_config(format="prompt_completion"), None, BYTE)


# ---------------------------------------------------------------- truncation, packing, epochs


def _example(n: int, line: int = 1, prompt: int = 1) -> Example:
    return Example(np.arange(n, dtype=np.int32) % 200 + 1, np.arange(n) >= prompt, line, str(line))


def test_truncation_modes():
    from jaxllm.data.examples import fit

    exs = [_example(5), _example(12, 2, prompt=4), _example(12, 3, prompt=10)]
    with pytest.raises(DataError, match="line 2: 12 tokens"):
        fit(exs, 8, "error")
    kept, truncated, dropped = fit(exs, 8, "drop")
    assert [e.line for e in kept] == [1] and (truncated, dropped) == (0, 2)
    kept, truncated, dropped = fit(exs, 8, "truncate")  # line 3's prompt alone fills the row: dropped
    assert [e.line for e in kept] == [1, 2] and (truncated, dropped) == (1, 1)
    assert len(kept[1].ids) == 9 and kept[1].learn.tolist() == [False] * 4 + [True] * 5


def _first_fit_by_scan(sizes, capacity, order):
    """First-fit-decreasing the slow way: scan every bin."""
    bins, free = [], []
    for i in sorted(order.tolist(), key=lambda i: -sizes[i]):
        b = next((k for k, f in enumerate(free) if f >= sizes[i]), len(bins))
        if b == len(bins):
            bins.append([]), free.append(capacity)
        bins[b].append(i)
        free[b] -= sizes[i]
    return bins


def test_first_fit_decreasing_equals_a_scan():
    rng = np.random.default_rng(3)
    for n, cap in ((1, 8), (7, 8), (200, 64), (1000, 512)):
        sizes = rng.integers(1, cap + 1, n).tolist()
        order = rng.permutation(n)
        assert packing.first_fit_decreasing(sizes, cap, order) == _first_fit_by_scan(sizes, cap, order)


def test_packed_rows_keep_examples_apart():
    """Every example once, in one row; within it, its own segment id, positions from 0, its tokens as inputs
    and targets (no target crosses an example boundary) and its mask; padding is segment 0 and uncounted."""
    rng = np.random.default_rng(0)
    exs = [Example(rng.integers(1, 250, n).astype(np.int32), rng.random(n) < 0.6, i, str(i))
           for i, n in enumerate(rng.integers(2, 30, 60))]
    rows = packing.make_rows(exs, 32, pack=True, seed=1)
    assert sorted(e for r in rows.members for e in r) == list(range(60)) and len(rows) < 60
    f = packing.build(rows, np.arange(len(rows)))
    for r, members in enumerate(rows.members):
        at = 0
        for seg, e in enumerate(members, 1):
            k = len(exs[e].ids) - 1
            sl = slice(at, at + k)
            assert (f["segment_ids"][r, sl] == seg).all() and f["positions"][r, sl].tolist() == list(range(k))
            assert f["inputs"][r, sl].tolist() == exs[e].ids[:-1].tolist()
            assert f["targets"][r, sl].tolist() == exs[e].ids[1:].tolist()
            assert f["loss_mask"][r, sl].tolist() == exs[e].learn[1:].astype(np.float32).tolist()
            at += k
        assert (f["segment_ids"][r, at:] == 0).all() and (f["loss_mask"][r, at:] == 0).all()


def test_epochs_visit_every_row_once_in_an_order_of_seed_and_epoch():
    n, b = 23, 5
    per = packing.steps_per_epoch(n, b)
    assert per == 5
    for epoch in range(3):
        seen = np.concatenate([packing.step_rows(n, b, 0, epoch * per + i) for i in range(per)])
        assert sorted(seen[seen != packing.EMPTY].tolist()) == list(range(n)) and (seen == packing.EMPTY).sum() == 2
    first = [packing.step_rows(n, b, 0, s) for s in range(2 * per)]
    assert not np.array_equal(first[0], first[per])  # another epoch, another order
    chex.assert_trees_all_equal(first, [packing.step_rows(n, b, 0, s) for s in range(2 * per)])
    assert not np.array_equal(first[0], packing.step_rows(n, b, 1, 0))


def test_one_example_per_row_and_a_batch_of_all_of_them(tmp_path):
    """data.pack=false with train.global_batch = the number of examples: step 0 holds each once."""
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    cfg = build_config(None, {"data.format": "chat", "data.source": path, "data.val_percent": 0,
                              "train.global_batch": 3, "model.seq_len": 128, "train.epochs": 4})
    data = dataset.load(cfg, BYTE)
    assert data.val is None and list(data.eval_batches(None)) == []
    notes = dataset.resolve_schedule(cfg, data)
    assert cfg.train.steps == 4 and "wins over train.steps" in notes[0]
    which = packing.step_rows(len(data.train), 3, cfg.train.seed, 0)
    f = packing.build(data.train, which)
    firsts = sorted(tuple(f["inputs"][i, :4]) for i in range(3))
    assert firsts == sorted(tuple(ex.ids[:4]) for ex in examples_of(path))
    assert data.padding_frac([0]) == pytest.approx(1 - sum(len(e.ids) - 1 for e in data.train.examples) / (3 * 128))


def test_validation_split_is_by_example_and_zero_means_none(tmp_path):
    from jaxllm.data.examples import split

    exs = [_example(5, i) for i in range(400)]
    train, val = split(exs, 10)
    assert 20 < len(val) < 60 and len(train) + len(val) == 400
    assert [e.line for e in split(exs, 10)[1]] == [e.line for e in val]  # the same every time
    assert split(exs, 0) == (exs, [])
    path = write_jsonl(tmp_path / "one.jsonl", [{"messages": CONVERSATIONS[0]}])  # nothing to hold out
    cfg = build_config(None, {"data.format": "chat", "data.source": path, "model.seq_len": 64})
    assert not dataset.load(cfg, BYTE).has_validation


def test_config_checks(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    for over, problem in (({"data.format": "tsv"}, "data.format"), ({"data.loss_on": "user"}, "data.loss_on"),
                          ({"data.truncation": "cut"}, "data.truncation"),
                          ({"data.format": "text", "train.epochs": 2}, "no epochs"),
                          ({"train.warmup_ratio": 1.5}, "warmup_ratio"),
                          ({"data.source": str(tmp_path)}, "not one")):
        cfg = build_config(None, {"data.format": "chat", "data.source": path, **over})
        with pytest.raises(UserError, match=problem):
            dataset.check_config(cfg)


def test_a_tiktoken_tokenizer_masks_the_same_replies():
    """The GPT-2 path (a tiktoken encoding; GPT-2's own files are not on this machine, so a small one with
    multi-byte merges): the learned tokens decode to exactly each reply and its end-of-text."""
    import tiktoken

    from jaxllm.data.tokenizers import TiktokenTokenizer

    ranks = {bytes([i]): i for i in range(256)}
    for merged in (b"As", b"Ass", b"st", b"an", b"ant", b": ", b"He", b"ll", b"llo", b"\nA"):
        ranks[merged] = len(ranks)
    enc = tiktoken.Encoding("small", pat_str=r"""'s|'t| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                            mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)})
    tok = TiktokenTokenizer(name="small", vocab_size=enc.n_vocab, eot=len(ranks), enc=enc)
    conv = CONVERSATIONS[1]
    ids, starts, ends = tok.encode_chat(chat.render(chat.load_template("", tok), conv)[0])
    assert any(len(enc.decode_single_token_bytes(int(i))) > 1 for i in ids if i != tok.eot)  # merges happened
    from jaxllm.data.examples import _chat_example

    ids, learn = _chat_example(conv, 0, lambda: chat.load_template("", tok), tok)
    pieces = np.split(ids[learn], np.flatnonzero(ids[learn] == tok.eot)[:-1] + 1)
    assert [tok.decode(p[:-1]) for p in pieces] == ["Hello!\nHow can I help?", " 4 5 6 "]
    assert all(p[-1] == tok.eot for p in pieces)


def test_the_template_file_wins_and_a_list_of_templates_uses_default(chatml_tokenizer, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(chatml_tokenizer, folder)
    assert get_tokenizer(f"hf:{folder}").chat_template == (TEMPLATES / "chatml.jinja").read_text()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert get_tokenizer(f"hf:{folder}").chat_template == "y"
    (folder / "chat_template.jinja").write_text("z")
    assert get_tokenizer(f"hf:{folder}").chat_template == "z"
    config["chat_template"] = [{"name": "tool_use", "template": "x"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(DataError, match="no 'default'"):
        get_tokenizer(f"hf:{folder}")


def test_chat_template_kwargs_is_a_table_in_files_and_on_the_command_line(tmp_path):
    """A TOML file, a command-line override and a run's written config.toml hold the table whole (it is a
    key's value, not a section of keys)."""
    from jaxllm.config import load_toml, parse_overrides, to_toml

    (tmp_path / "c.toml").write_text('[data]\nformat = "chat"\nchat_template_kwargs = {enable_thinking = false}\n')
    from_file = build_config(str(tmp_path / "c.toml"), [])
    from_cli = build_config(None, parse_overrides(["data.chat_template_kwargs={enable_thinking=false, n=2}"]))
    assert from_file.data.chat_template_kwargs == {"enable_thinking": False}
    assert from_cli.data.chat_template_kwargs == {"enable_thinking": False, "n": 2}
    (tmp_path / "run.toml").write_text(to_toml(from_cli))
    assert load_toml(str(tmp_path / "run.toml"))["data.chat_template_kwargs"] == {"enable_thinking": False, "n": 2}
    with pytest.raises(UserError, match="chat_template_kwargs: expected a table"):
        build_config(None, parse_overrides(["data.chat_template_kwargs=3"]))
