"""Small real tokenizers of four families for the cross-tokenizer tests, trained here (cached per session).

- "char":   the shipped demo tokenizer (data/tokenizer): one token per printable ASCII character, Fuse decoder
- "bpe":    byte-level BPE (GPT-2's pre-tokenizer and alphabet: `Ġ` for a space, any byte is a token)
- "unigram": a SentencePiece-style unigram with a Metaspace pre-tokenizer (`▁`, a prefix space on the first
            word) and byte fallback (`<0x0A>`), its eos spelled `</s>`
- "sp_legacy": a unigram laid out as Llama-2's tokenizer.json: Prepend/Replace normalizers, no pre-tokenizer,
            decoder Replace + ByteFallback + Fuse + Strip; it also holds `<0x61>` beside `a` (two ids, one spelling)

Each trains on a small mixed corpus in well under a second.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

DATA = Path(__file__).resolve().parents[1] / "data"

CORPUS = [
    "What is 37 + 48?\n #### 85",
    "What is 66 + 80?\n ans= 146",
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "The answer is 42; the question is unknown.\n\tIndented  with   spaces.",
    "naïve café, résumé: déjà vu — 東京 and 😀 emoji!",
    "def f(x):\n    return x * 2  # double it",
    "Numbers: 3.14159, 2718, 1e-3, -17 and 100%.",
] * 20


def _fast(core: Tokenizer, eos: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=eos, pad_token="<pad>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


@functools.cache
def char() -> PreTrainedTokenizerFast:
    from opd_cache.tokenizer import load_tokenizer

    return load_tokenizer(DATA / "tokenizer")


@functools.cache
def demo_bpe() -> PreTrainedTokenizerFast:
    from opd_cache.tokenizer import load_tokenizer

    return load_tokenizer(DATA / "tokenizer_bpe")


@functools.cache
def bpe() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<pad>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer)
    return _fast(core, "<eos>")


def _unigram_with_byte_fallback(normalizer, pre_tokenizer, extra: list[tuple[str, float]]) -> Tokenizer:
    """Train a unigram, then rebuild it with the 256 byte tokens and byte fallback (as SentencePiece does)."""
    core = Tokenizer(models.Unigram())
    core.normalizer, core.pre_tokenizer = normalizer, pre_tokenizer
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    core.train_from_iterator(CORPUS, trainer)
    model = json.loads(core.to_str())["model"]
    vocab = [tuple(v) for v in model["vocab"]] + extra + [(f"<0x{b:02X}>", -40.0) for b in range(256)]
    rebuilt = Tokenizer(models.Unigram(vocab, model["unk_id"], byte_fallback=True))
    rebuilt.normalizer, rebuilt.pre_tokenizer = normalizer, pre_tokenizer
    rebuilt.add_special_tokens(["<pad>", "</s>", "<unk>"])
    return rebuilt


@functools.cache
def unigram() -> PreTrainedTokenizerFast:
    core = _unigram_with_byte_fallback(None, pre_tokenizers.Metaspace(prepend_scheme="first"), [])
    core.decoder = decoders.Sequence(
        [decoders.Metaspace(prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()]
    )
    return _fast(core, "</s>")


@functools.cache
def sp_legacy() -> PreTrainedTokenizerFast:
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core = _unigram_with_byte_fallback(normalizer, None, [])
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _fast(core, "</s>")


TOKENIZERS = {"char": char, "bpe": bpe, "unigram": unigram, "sp_legacy": sp_legacy, "demo_bpe": demo_bpe}


def get(name: str) -> PreTrainedTokenizerFast:
    return TOKENIZERS[name]()
