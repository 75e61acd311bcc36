"""`data.tokenizer = "hf:DIR"`: a Hugging Face tokenizer folder read with the `tokenizers` library.

- encode and decode equal transformers' AutoTokenizer (the reference, a test dependency only) on the
  committed fixtures (tools/examples/make_hf_tokenizer.py): a LLaMA-3 style one whose post-processor adds BOS,
  a GPT-2 style one without BOS, and a Gemma style one (SentencePiece-style BPE with byte fallback, which
  transformers' GemmaTokenizer rebuilds its pipeline for); also with variants of tokenizer_config.json, and a WordPiece tokenizer
  whose decode cleans up spaces.
- The BOS rule: never doubled, neither by encode nor in the corpus streams.
- Stop ids: tokenizer_config.json's eos, then generation_config.json's (one only there).
- Each refusal is one line naming the problem and the fix, through the command line, exit 2.
- The trainer's command line trains two steps with the fixture tokenizer (slow tier).
"""

import json
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from harness import CORPUS, REPO, subprocess_env
from jaxllm.config import build_config
from jaxllm.data import get_tokenizer, load_corpus, read_shard
from jaxllm.data.corpus import check_config
from jaxllm.errors import DataError
from jaxllm.schema import DataConfig
from jaxllm.trainer.loop import resolve

LLAMA = REPO / "tests" / "fixtures" / "hf_tokenizer"
GPT2 = REPO / "tests" / "fixtures" / "hf_tokenizer_gpt2"
GEMMA = REPO / "tests" / "fixtures" / "hf_tokenizer_gemma"
FIXTURES = {"llama3": LLAMA, "gpt2": GPT2, "gemma": GEMMA}
BOS, EOS, EOT_ID = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIAL = [BOS, EOS, EOT_ID, "<|start_header_id|>", "<|end_header_id|>", "<|endoftext|>"]
PIECES = SPECIAL + [
    "Hello world", " the quick brown fox", "don't", "WE'LL", "x = f(y) + 42", "3.14159", "1234567", "def f():\n",
    "    return 1\n", "\tif (a && b) {}", "héllo", "naïve café", "Grüße", "日本語", "你好，世界", "안녕하세요",
    "Привет", "مرحبا", "🙂", "👍🏽", "❤️", "e\u0301", "\u00a0nbsp", "zero\u200bwidth", "\r\n", "\n\n\n", "   ",
    "\t\t", " ", "  trailing  ", "<|eot_id", "|>", "<", "<|", "a" * 40, "ab" * 15, ".", "?!", "...",
]


def _strings() -> list[str]:
    """100 texts: special tokens at the start, middle and end, unicode, whitespace runs and edge cases."""
    fixed = ["", " ", "\n", "   \n\t ", BOS, BOS + BOS, BOS + "Hello", BOS + " Hello", "Hello" + BOS, EOS,
             EOT_ID + "\n",
             "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>", "  " + BOS + "x",
             "<|endoftext|>", "a<|endoftext|>b", "<|begin_of_text", "\u00e9\u0301\u0302", "🙂" * 5]
    rng = random.Random(0)
    drawn = ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 7))) for _ in range(100 - len(fixed))]
    return fixed + drawn


STRINGS = _strings()


@pytest.fixture(scope="module")
def auto():
    """AutoTokenizer.from_pretrained(folder), once per folder."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()  # its warning about clean_up_tokenization_spaces on BPE
    loaded = {}

    def load(folder):
        if str(folder) not in loaded:
            loaded[str(folder)] = transformers.AutoTokenizer.from_pretrained(str(folder))
        return loaded[str(folder)]

    return load


def _expected(tok, ref, text: str) -> list[int]:
    """AutoTokenizer's ids, less the BOS it doubles when the text begins with the BOS string (our one departure)."""
    ids = ref.encode(text)
    if tok.add_bos and ids[:2] == [tok.bos, tok.bos]:
        ids = ids[1:]
    return ids


def _check_equal(tok, ref, strings) -> None:
    for text in strings:
        ids = tok.encode(text)
        assert ids.dtype == np.uint16
        assert ids.tolist() == _expected(tok, ref, text), repr(text)
        assert tok.decode(ids) == ref.decode(ids.tolist()), repr(text)
        full = ref.encode(text)  # the doubled BOS too
        assert tok.decode(full) == ref.decode(full), repr(text)


@pytest.mark.parametrize("name", FIXTURES)
def test_encode_and_decode_equal_autotokenizer(name, auto):
    folder = FIXTURES[name]
    tok, ref = get_tokenizer(f"hf:{folder}"), auto(folder)
    assert tok.vocab_size == len(ref) == len(ref.get_vocab()) and tok.vocab_size % 128
    assert (tok.bos, tok.eot) == (ref.bos_token_id, ref.eos_token_id)
    assert tok.source_dir == str(folder) and tok.name == f"hf:{folder}"
    assert len(STRINGS) == 100 and sum(any(s in t for s in SPECIAL) for t in STRINGS) > 40
    _check_equal(tok, ref, STRINGS)
    # any ids, cut UTF-8 sequences and special tokens included
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, tok.vocab_size, size=rng.integers(1, 20)).tolist()
        assert tok.decode(ids) == ref.decode(ids), ids
        assert tok.decode(np.asarray(ids, np.uint32)) == ref.decode(ids)


def test_fixtures_are_what_the_script_makes(tmp_path):
    """tools/examples/make_hf_tokenizer.py rewrites the committed fixtures byte for byte (deterministic, offline)."""
    from tools.examples import make_hf_tokenizer

    assert make_hf_tokenizer.main([str(tmp_path)]) == 0
    for folder in FIXTURES.values():
        made = tmp_path / folder.name
        assert sorted(p.name for p in made.iterdir()) == sorted(p.name for p in folder.iterdir())
        for path in folder.iterdir():
            assert (made / path.name).read_bytes() == path.read_bytes(), path
        assert sum(p.stat().st_size for p in folder.iterdir()) < 100_000


def test_bos_is_added_once_and_never_doubled():
    tok = get_tokenizer(f"hf:{LLAMA}")
    assert tok.add_bos and tok.bos == tok.tok.token_to_id(BOS)
    plain = tok.encode("Hello world").tolist()
    assert plain[0] == tok.bos and plain.count(tok.bos) == 1
    assert tok.encode(BOS + "Hello world").tolist() == plain  # the text's own BOS, not another
    assert tok.encode("").tolist() == [tok.bos]
    assert tok.encode(BOS).tolist() == [tok.bos]
    assert tok.encode(BOS + BOS + "x").tolist() == [tok.bos, tok.bos] + tok.encode("x").tolist()[1:]  # the text's two
    assert tok.decode(tok.encode(BOS + "Hello world")) == BOS + "Hello world"
    gpt2 = get_tokenizer(f"hf:{GPT2}")
    assert not gpt2.add_bos and gpt2.bos == gpt2.eot  # <|endoftext|> is both; the post-processor adds nothing
    assert gpt2.tok.token_to_id("<|endoftext|>") not in gpt2.encode("Hello world").tolist()


def _documents(stream: np.ndarray, eot: int) -> list[list[int]]:
    """The stream cut at its end-of-text ids: each document's ids."""
    assert stream[0] == eot
    cuts = np.flatnonzero(stream == eot).tolist() + [len(stream)]
    return [stream[a + 1:b].tolist() for a, b in zip(cuts, cuts[1:])]


def test_corpus_streams_hold_one_bos_per_document(tmp_path):
    tok = get_tokenizer(f"hf:{LLAMA}")
    folder = tmp_path / "docs"
    folder.mkdir()
    texts = {f"{i}.txt": (BOS if i % 2 else "") + f"document {i}\nsecond line\n" * 3 for i in range(20)}
    for name, text in texts.items():
        (folder / name).write_text(text)
    corpus = load_corpus(str(folder), tok, 30)
    docs = _documents(corpus.train, tok.eot) + _documents(corpus.val, tok.eot)
    assert len(docs) == 20
    for doc in docs:
        assert doc[0] == tok.bos and doc.count(tok.bos) == 1 and tok.eot not in doc, doc[:5]
    # one text file beginning with the BOS string: each stream still starts eot, bos, then text
    (tmp_path / "one.txt").write_text(BOS + "line\n" * 200)
    one = load_corpus(str(tmp_path / "one.txt"), tok, 10)
    for stream in (one.train, one.val):
        assert stream[:2].tolist() == [tok.eot, tok.bos] and stream.tolist().count(tok.bos) == 1
    # GPT-2 style (bos = eos = <|endoftext|>, none added): each stream is one eot, then the text's ids
    gpt2 = get_tokenizer(f"hf:{GPT2}")
    plain = load_corpus(str(tmp_path / "one.txt"), gpt2, 10)
    for stream in (plain.train, plain.val):
        assert stream[0] == gpt2.eot and gpt2.eot not in stream[1:]
    assert gpt2.decode(plain.train[1:]) + gpt2.decode(plain.val[1:]) == (tmp_path / "one.txt").read_text()


def test_stop_ids_include_the_one_only_in_generation_config():
    tok = get_tokenizer(f"hf:{LLAMA}")
    config = json.loads((LLAMA / "tokenizer_config.json").read_text())
    generation = json.loads((LLAMA / "generation_config.json").read_text())
    eos, eot_id = tok.tok.token_to_id(EOS), tok.tok.token_to_id(EOT_ID)
    assert config["eos_token"] == EOS and EOT_ID not in json.dumps({k: config[k] for k in config if "token" in k
                                                                   and k != "added_tokens_decoder"})
    assert generation["eos_token_id"] == [eos, eot_id]
    assert tok.stop_ids == (eos, eot_id) and tok.eot == eos


def _variant(tmp_path, name: str, config: dict, generation: dict | None = None, drop: tuple = ()):
    """A copy of the LLaMA-3 fixture with tokenizer_config.json keys replaced (None deletes) and another
    generation_config.json."""
    folder = tmp_path / name
    shutil.copytree(LLAMA, folder)
    path = folder / "tokenizer_config.json"
    cfg = {**json.loads(path.read_text()), **config}
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    for f in drop:
        (folder / f).unlink()
    return folder


def _added(text: str) -> dict:
    """A special token as transformers 4 wrote it into tokenizer_config.json."""
    return {"__type": "AddedToken", "content": text, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def test_config_variants_equal_autotokenizer(tmp_path, auto):
    """As transformers 5 with a tokenizer.json: tokenizer_config.json's add_bos_token / add_eos_token change
    nothing (the post-processor is tokenizer.json's); a named special token in the vocabulary but not added
    (pad_token "ll") becomes a special added token; tokens as dicts with "content"; a generation eos_token_id
    that is one id."""
    ref_ids = get_tokenizer(f"hf:{LLAMA}").tok
    bos, eos, eot_id = (ref_ids.token_to_id(t) for t in (BOS, EOS, EOT_ID))
    flags = _variant(tmp_path, "flags", {"add_bos_token": False, "add_eos_token": True})
    marked = _variant(tmp_path, "marked", {"pad_token": "ll"})
    dicts = _variant(tmp_path, "dicts", {"bos_token": _added(BOS), "eos_token": _added(EOT_ID)},
                     generation={"eos_token_id": eos}, drop=("special_tokens_map.json",))
    for folder in (flags, marked, dicts):
        _check_equal(get_tokenizer(f"hf:{folder}"), auto(folder), STRINGS[:40] + ["Hello, hello! HELLO shell"])
    assert get_tokenizer(f"hf:{flags}").encode("x").tolist() == get_tokenizer(f"hf:{LLAMA}").encode("x").tolist()
    ll = ref_ids.token_to_id("ll")  # BPE encodes "Hello" as H, el, lo; the added token cuts out "ll"
    assert ll not in get_tokenizer(f"hf:{LLAMA}").encode("Hello").tolist()
    assert ll in get_tokenizer(f"hf:{marked}").encode("Hello").tolist()
    tok = get_tokenizer(f"hf:{dicts}")
    assert (tok.bos, tok.stop_ids, tok.eot) == (bos, (eot_id, eos), eot_id)


def test_wordpiece_decode_cleans_up_spaces_as_transformers(tmp_path, auto):
    """clean_up_tokenization_spaces applies to a non-BPE model (transformers 5 skips it for BPE only)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "[SEP]", "hello", ",", "world", "!", "don", "'", "t", ".", "##s", "?"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    folder = tmp_path / "wordpiece"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "[SEP]", "unk_token": "[UNK]", "clean_up_tokenization_spaces": True,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    ours, ref = get_tokenizer(f"hf:{folder}"), auto(folder)
    texts = ["hello, world!", "don't.", "hello worlds ?", "hello [SEP] world", "x y"]
    _check_equal(ours, ref, texts)
    assert ours.decode(ours.encode("hello, world!")) == "hello, world!" and ours.eot == 1 and ours.bos is None


def test_config_accepts_hf_and_fills_the_vocabulary():
    assert check_config(DataConfig(source=CORPUS, tokenizer=f"hf:{LLAMA}")) == []
    cfg = build_config(None, {"data.tokenizer": f"hf:{LLAMA}", "data.source": CORPUS, "model.preset": "tiny-llama"})
    tok, _, _ = resolve(cfg)
    assert cfg.model.vocab_size == tok.vocab_size == 605
    with pytest.raises(DataError, match="choose one of byte, gpt2, hf:DIR"):
        check_config(DataConfig(source=CORPUS, tokenizer="sentencepiece"))


def test_sampling_stops_at_a_stop_id_only_generation_config_names(monkeypatch):
    """The end-of-run sample stops at <|eot_id|>: a model that always predicts it adds nothing to the prompt."""
    import jax
    import jax.numpy as jnp
    from jaxllm.generate import decode
    from jaxllm.models import transformer
    from jaxllm.trainer import loop

    tok = get_tokenizer(f"hf:{LLAMA}")
    eot_id = tok.tok.token_to_id(EOT_ID)
    cfg = build_config(None, {"model.preset": "tiny-llama", "model.vocab_size": 640, "precision.compute": "float32"})
    params = transformer.init_params(cfg.model, jax.random.key(0))

    def always_eot_id(params, x, m, dtype):
        return jnp.broadcast_to(jnp.where(jnp.arange(640) == eot_id, 50.0, 0.0), (*x.shape[:2], 640))

    monkeypatch.setattr(decode.transformer, "_logits", always_eot_id)  # the head, at every position or one
    monkeypatch.setattr(decode, "_programs", {})  # compiled afresh with the model above, and forgotten after
    assert loop.sample(params, cfg, tok, "def ", 8) == BOS + "def "


def test_prepare_data_writes_hf_token_shards(tmp_path):
    from jaxllm.cli import prepare_data

    tok = get_tokenizer(f"hf:{LLAMA}")
    assert prepare_data.main([CORPUS, str(tmp_path / "shards"), "--tokenizer", f"hf:{LLAMA}", "--name", "os"]) == 0
    corpus = load_corpus(CORPUS, tok, 5.0)
    assert np.array_equal(read_shard(tmp_path / "shards" / "os_val_000000.bin"), corpus.val)
    assert np.array_equal(read_shard(tmp_path / "shards" / "os_train_000001.bin"), corpus.train)


# ---------------------------------------------------------------- refusals: one line, exit 2, nothing written

def _folder_with(tmp_path, files: dict) -> str:
    folder = tmp_path / "tok"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return str(folder)


CONFIG = json.dumps({"bos_token": "<s>", "eos_token": "</s>"}).encode()
REFUSED = {  # name -> (make DIR under tmp_path, the line after "error: ", {d} for DIR, … for the library's words)
    "missing_dir": (lambda t: str(t / "nope"),
                    "data.tokenizer=hf:{d}: no such folder '{d}'; give hf:DIR with DIR a folder holding a Hugging "
                    "Face tokenizer.json"),
    "sentencepiece_only": (lambda t: _folder_with(t, {"tokenizer.model": b"\x0a\x0b<unk>", "tokenizer_config.json":
                                                      CONFIG}),
                           "data.tokenizer=hf:{d}: '{d}' has only a sentencepiece tokenizer.model, and jaxllm reads "
                           "tokenizer.json; convert it on a machine with transformers: "
                           "AutoTokenizer.from_pretrained('{d}').save_pretrained('{d}')"),
    "no_tokenizer_json": (lambda t: _folder_with(t, {"tokenizer_config.json": CONFIG}),
                          "data.tokenizer=hf:{d}: no tokenizer.json in '{d}'; give the folder of a Hugging Face "
                          "tokenizer (tokenizer.json, with tokenizer_config.json and generation_config.json "
                          "beside it)"),
    "unreadable_tokenizer_json": (lambda t: _folder_with(t, {"tokenizer.json": b'{"version": "1.0", "model": '}),
                                  "data.tokenizer=hf:{d}: cannot read {d}/tokenizer.json (…); replace it with a "
                                  "tokenizer.json saved by the tokenizers library or transformers"),
    "a_file_not_a_folder": (lambda t: str(LLAMA / "tokenizer.json"),
                            "data.tokenizer=hf:{d}: '{d}' is not a folder; give the folder that holds tokenizer.json, "
                            f"hf:{LLAMA}"),
    "bad_tokenizer_config": (lambda t: _folder_with(t, {"tokenizer.json": (LLAMA / "tokenizer.json").read_bytes(),
                                                        "tokenizer_config.json": b"{'eos_token': 1}"}),
                             "data.tokenizer=hf:{d}: cannot read {d}/tokenizer_config.json (Expecting property name "
                             "enclosed in double quotes: line 1 column 2 (char 1)); fix it or remove it"),
    "bos_not_in_vocabulary": (lambda t: _folder_with(t, {"tokenizer.json": (LLAMA / "tokenizer.json").read_bytes(),
                                                         "tokenizer_config.json": CONFIG}),
                              "data.tokenizer=hf:{d}: tokenizer_config.json's bos_token '<s>' is not in "
                              "tokenizer.json's vocabulary; fix bos_token in {d}/tokenizer_config.json"),
    "no_eos_anywhere": (lambda t: _folder_with(t, {"tokenizer.json": (LLAMA / "tokenizer.json").read_bytes()}),
                        "data.tokenizer=hf:{d}: no end-of-text token: neither tokenizer_config.json's eos_token nor "
                        "generation_config.json's eos_token_id names one; add eos_token to {d}/tokenizer_config.json"),
    "generation_id_outside": (lambda t: _folder_with(t, {"tokenizer.json": (LLAMA / "tokenizer.json").read_bytes(),
                                                         "generation_config.json": b'{"eos_token_id": [1, 605]}'}),
                              "data.tokenizer=hf:{d}: generation_config.json's token id 605 is not an id of the "
                              "tokenizer (0..604); fix {d}/generation_config.json"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refusals_are_one_line_exit_2_nothing_written(case, tmp_path, capsys):
    from jaxllm.cli import train as run_cli

    make, message = REFUSED[case]
    folder, run_dir = make(tmp_path), tmp_path / "run"
    assert run_cli.main([f"data.tokenizer=hf:{folder}", f"data.source={CORPUS}", f"run.dir={run_dir}",
                         "model.preset=tiny-llama"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.fullmatch(".+".join(map(re.escape, message.format(d=folder).split("…"))), lines[0][len("error: "):])
    assert not run_dir.exists()
    with pytest.raises(DataError):  # and from get_tokenizer itself
        get_tokenizer(f"hf:{folder}")


# ---------------------------------------------------------------- the trainer's command line

@pytest.mark.slow
def test_cli_trains_two_steps_with_an_hf_tokenizer(tmp_path):
    """One device, tiny LLaMA, the fixture tokenizer as a relative path, as a user types it; its 605 ids
    (padded to 640 in the model), stop ids and BOS through training, evaluation and the sample."""
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "jaxllm", "train", "data.tokenizer=hf:tests/fixtures/hf_tokenizer",
                          "model.preset=tiny-llama", "model.seq_len=32", "train.steps=2", "train.global_batch=2",
                          "train.warmup_steps=1", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
                          "train.checkpoint_every=0", "run.sample_tokens=8", "run.progress=false", "mesh.dp=1",
                          f"data.source={CORPUS}", f"run.dir={run_dir}"],
                         cwd=REPO, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses)) and abs(losses[0] - np.log(605)) < 0.5
    assert any(np.isfinite(r["val_loss"]) for r in rows if "val_loss" in r)
    assert 'tokenizer = "hf:tests/fixtures/hf_tokenizer"' in (run_dir / "config.toml").read_text()
    assert "vocab_size = 605" in (run_dir / "config.toml").read_text()
    assert (run_dir / "sample.txt").read_text().startswith(BOS + "def ")  # the prompt, after the BOS encode added
