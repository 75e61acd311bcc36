"""Make the small Hugging Face tokenizer folders the tests load with `data.tokenizer = "hf:DIR"`:

    python -m tools.examples.make_hf_tokenizer [OUT_ROOT]  # default: tests/fixtures

- `hf_tokenizer/`: LLaMA-3 style. A byte-level BPE (LLaMA 3's pre-tokenizer regex, `ignore_merges`)
  with added special tokens after the BPE ids (<|begin_of_text|>, <|end_of_text|>, <|eot_id|>,
  <|start_header_id|>, <|end_header_id|>), a post-processor that prepends <|begin_of_text|>
  (TemplateProcessing, as LLaMA 3's tokenizer.json does), tokenizer_config.json with bos/eos and a
  chat template, and generation_config.json whose eos_token_id list also holds <|eot_id|>, a stop
  id that tokenizer_config.json does not name (as LLaMA 3 Instruct's files do).
- `hf_tokenizer_gpt2/`: GPT-2 style. Byte-level BPE with GPT-2's pre-tokenizer and one special
  token, <|endoftext|>, which is both bos and eos; no BOS is added to an encoding.
- `hf_tokenizer_gemma/`: Gemma style. A SentencePiece-style BPE: spaces normalised to "▁", byte
  fallback (<0x00>..<0xFF> in the vocabulary after the special tokens, as Gemma's), Gemma's special
  tokens (<pad>, <eos>, <bos>, <unk>, <mask>, <start_of_turn>, <end_of_turn>), a post-processor that
  prepends <bos>, tokenizer_config.json naming GemmaTokenizer (which transformers 5 rebuilds its
  pipeline for) with the Gemma chat template of tests/fixtures/chat_templates/gemma.jinja, and
  generation_config.json stopping at <eos> and <end_of_turn>, as Gemma 3's instruct models do.

Both are trained with the `tokenizers` library on the text below (in this file, so the output does
not depend on the machine, the Python version or the network) and are deterministic: running the
script again writes byte-identical files. The vocabularies (605, 401 and 522 ids) are not multiples
of 128, so the model's padded vocabulary differs from the tokenizer's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

REPO = Path(__file__).resolve().parents[2]

# LLaMA 3's pre-tokenizer split (from its tokenizer.json): contractions, letters, 1-3 digits, punctuation,
# newlines and other whitespace.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
# LLaMA 3 Instruct's chat template, shortened (no tools, no date).
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

TEXT = """\
A tokenizer turns text into a sequence of integer ids and back. Byte-level BPE starts from the 256 byte
values, so every string can be encoded, and learns merges of frequent pairs: the most frequent pair of
adjacent symbols becomes a new symbol, again and again, until the vocabulary is full. The model sees
only ids; the tokenizer decides what an id means. Training data is a stream of documents, each one
marked at its start or end by a special token, so the model learns where a text begins and ends.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! How vexingly
quick daft zebras jump? Sphinx of black quartz, judge my vow. We're sure it's fine; they'll see, I'd
say, and you've been told: don't panic. She said "hello", he said 'goodbye' -- and then: nothing.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 65536 3.14159 2.71828 1e-3 -7 +12 50% $9.99.
Dates and times: 2024-05-20, 12:30:45, 1999/12/31. Versions: v1.2.3, 0.10.0, Python 3.11.

def encode(text: str) -> list[int]:
    \"\"\"Encode text as a list of token ids.\"\"\"
    ids = []
    for word in text.split():
        if word in vocab:
            ids.append(vocab[word])
        else:
            ids.extend(byte + 3 for byte in word.encode("utf-8"))
    return ids


class Trainer:
    def __init__(self, lr=1e-3, steps=100, batch_size=16):
        self.lr, self.steps, self.batch_size = lr, steps, batch_size

    def step(self, params, grads):
        return {k: v - self.lr * grads[k] for k, v in params.items()}

    for i in range(10):
        print(f"step {i}: loss = {loss:.4f}")  # log every step
\tif (x != y && z >= 0) { return x * y / z; }   // C-like code, with a tab
    <html><body><p class="note">Markup &amp; entities &lt;b&gt;</p></body></html>
    {"name": "jaxllm", "vocab_size": 605, "tokens": [1, 2, 3], "ok": true, "none": null}

Le renard brun rapide saute par-dessus le chien paresseux. Où est la bibliothèque ? À bientôt, déjà vu.
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München, Straße, Fußgänger, Ärger.
El veloz murciélago hindú comía feliz cardillo y kiwi. ¿Dónde está? ¡Señor, mañana!
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!
Γρήγορη καφέ αλεπού. Καλημέρα κόσμε. Ελληνικά γράμματα: α β γ δ ε.
敏捷的棕色狐狸跳过了懒狗。你好，世界！日本語のテキスト、こんにちは。한국어 텍스트, 안녕하세요.
עברית: שלום עולם. العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया।
Emoji and symbols: 🙂 🚀 ✨ 👍🏽 ❤️ → ← ↑ ↓ ∑ ∫ √ ∞ ≤ ≥ ≠ ± × ÷ © ® ™ € £ ¥ • … « » “ ” ‘ ’

Whitespace matters:    four spaces,\t\ttwo tabs,  two spaces.
Lines end here.

And a paragraph after a blank line.
   Indented text.
        More indented text.
Trailing spaces   \n\nTwo newlines above; three below.



The end.
"""


def _train(pre_tokenizer, vocab_size: int, llama: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=llama))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 3 + TEXT.split("\n\n"), trainer)
    if llama:  # the trainer builds a fresh BPE model, so the option is set again
        tok.model.ignore_merges = True
    return tok


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _added_tokens_decoder(tok: Tokenizer, names: list[str]) -> dict:
    return {str(tok.token_to_id(n)): {"content": n, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True} for n in names}


def make_llama3(out: Path) -> None:
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                            use_regex=False)])
    tok = _train(pre, 600, llama=True)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIAL])
    bos, eos, eot = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, bos_id)])])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": _added_tokens_decoder(tok, LLAMA3_SPECIAL),
        "bos_token": bos, "eos_token": eos, "chat_template": LLAMA3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast"})
    _write_json(out / "special_tokens_map.json", {"bos_token": bos, "eos_token": eos})
    _write_json(out / "generation_config.json", {
        "bos_token_id": bos_id, "eos_token_id": [tok.token_to_id(eos), tok.token_to_id(eot)],
        "do_sample": True, "temperature": 0.6, "top_p": 0.9})


def make_gpt2(out: Path) -> None:
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), 400, llama=False)
    eot = "<|endoftext|>"
    tok.add_special_tokens([AddedToken(eot, special=True, normalized=False)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": _added_tokens_decoder(tok, [eot]), "add_prefix_space": False,
        "bos_token": eot, "eos_token": eot, "unk_token": eot, "model_max_length": 1024,
        "tokenizer_class": "GPT2Tokenizer"})
    eot_id = tok.token_to_id(eot)
    _write_json(out / "generation_config.json", {"bos_token_id": eot_id, "eos_token_id": eot_id})


GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def make_gemma(out: Path) -> None:
    """Pieces trained on TEXT with spaces as "▁"; then the vocabulary laid out as Gemma's: special tokens,
    the 256 byte-fallback tokens, the pieces."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.train_from_iterator([TEXT] * 3 + TEXT.split("\n\n"), trainers.BpeTrainer(
        vocab_size=256, min_frequency=1, show_progress=False, special_tokens=GEMMA_SPECIAL))
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIAL + [f"<0x{b:02X}>" for b in range(256)])}
    for piece, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in GEMMA_SPECIAL])
    bos = vocab["<bos>"]
    tok.post_processor = processors.TemplateProcessing(single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1",
                                                       special_tokens=[("<bos>", bos)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    template = (REPO / "tests" / "fixtures" / "chat_templates" / "gemma.jinja").read_text(encoding="utf-8")
    _write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": _added_tokens_decoder(tok, GEMMA_SPECIAL), "add_bos_token": True,
        "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "mask_token": "<mask>", "chat_template": template, "model_max_length": 1024,
        "tokenizer_class": "GemmaTokenizer"})
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": [vocab["<eos>"],
                                                                                       vocab["<end_of_turn>"]]})


FOLDERS = {"hf_tokenizer": make_llama3, "hf_tokenizer_gpt2": make_gpt2, "hf_tokenizer_gemma": make_gemma}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.examples.make_hf_tokenizer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out_root", nargs="?", default=str(REPO / "tests" / "fixtures"),
                        help=f"folder to write {', '.join(FOLDERS)} into")
    args = parser.parse_args(argv)
    root = Path(args.out_root)
    for folder, make in FOLDERS.items():
        make(root / folder)
        size = sum(p.stat().st_size for p in (root / folder).iterdir())
        print(f"wrote {root / folder} ({size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
