"""Build the demo's second tokenizer: a small byte-level BPE, written to data/tokenizer_bpe/.

The cross-tokenizer demo (docs/cross-tokenizer.md) pairs the character-level teacher of data/models/ with a
student of another tokenizer. This one is trained with the `tokenizers` library on the demo's own text: every
training prompt as the chat template renders it, followed by both answer formats (" #### 85" and
" ans= 85"). It keeps the character tokenizer's conventions, so only the tokenization differs:

- the same special tokens with the same ids (`<pad>` 0, `<eos>` 1, `<unk>` 2) and the same chat template
  (a user message is its text plus a newline; the answer follows and ends with `<eos>`);
- GPT-2's byte-level pre-tokenizer and decoder, over the character tokenizer's alphabet (newline and printable
  ASCII, as byte-level symbols: ' ' is `Ġ`, '\\n' is `Ċ`; any other byte is `<unk>`). All 256 bytes made the
  student sample bytes the teacher cannot spell (its rows are excluded, so nothing pushed those bytes back
  down) as soon as distillation moved it off its own format. Words and runs of punctuation merge:
  " #### 85" is `Ġ` `####` `Ġ` `8` `5` here and eight characters there, " ans= 85" is `Ġ` `ans` `=` `Ġ` `8` `5`,
  "What is" is `What` `Ġ` `is`;
- digits and spaces are pre-tokens of their own (`Digits(individual_digits=True)`, `Split(" ", "isolated")`,
  then the byte-level split), as in the character tokenizer. The first version merged numbers and the space
  before a word (`Ġ85`, `Ġ14` `6`, `Ġans`, `Ġ####`). Distilled from the character teacher, that student
  unlearned its number tokens (the teacher's target at the start of ` 85` is its ` `), and the choice between
  the two formats sat at the start of ` ans` / ` ####`, where the teacher's target (` `) is a token the student
  never wrote there: it went through a phase of random bytes and lost its sums (docs/cross-tokenizer.md,
  "Measured on the example"). Now the space is one to one, the format decision is the group `ans` against the
  teacher's `a` `n` `s` (the teacher's target at its start is `#`), and the sums are decided at one-to-one
  positions that get the teacher's full top-k.

The output is deterministic (the same corpus and trainer settings give the same merges, hence the same
tokenizer fingerprint). It lives in its own folder: transformers 5 picks another tokenizer class when a
model's config.json sits beside a tokenizer.

    python data/make_bpe_tokenizer.py             # writes data/tokenizer_bpe/ and prints the comparison
    python data/make_bpe_tokenizer.py --out DIR --vocab-size 400
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

DATA = Path(__file__).resolve().parent
DEFAULT_OUT = DATA / "tokenizer_bpe"
TRAIN_PROMPTS = DATA / "arithmetic" / "train.parquet"
TEST_PROMPTS = DATA / "arithmetic" / "test.parquet"
# an upper bound: with digits and spaces split the corpus has 8 merges ('What', 'is', 'ans', '####' and their
# parts), so the tokenizer stops at 107 tokens (3 special tokens, 96 characters, 8 merges)
DEFAULT_VOCAB_SIZE = 400


def _character_tokenizer_module():
    """data/make_tokenizer.py (the character tokenizer's constants: special tokens, chat template)."""
    spec = importlib.util.spec_from_file_location("make_tokenizer", DATA / "make_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def byte_level_alphabet(characters: list[str]) -> list[str]:
    """The byte-level symbols of `characters` (GPT-2's table: ' ' is 'Ġ', '\\n' is 'Ċ')."""
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [spell.pre_tokenize_str(c)[0][0] for c in characters]


def demo_texts(path: Path = TRAIN_PROMPTS) -> list[str]:
    """The demo's text: each prompt as the chat template renders it, then each answer format."""
    from opd_cache.tasks.arithmetic import student_answer, teacher_answer

    table = pq.read_table(path, columns=["prompt", "reward_model"]).to_pylist()
    texts = []
    for row in table:
        prompt = "".join(m["content"] + "\n" for m in row["prompt"])  # the chat template's rendering
        truth = row["reward_model"]["ground_truth"]
        texts += [prompt + teacher_answer(truth), prompt + student_answer(truth)]
    return texts


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    chars = _character_tokenizer_module()
    core = Tokenizer(models.BPE(unk_token=chars.UNK))
    # digits first, one pre-token each (then GPT-2's byte-level split): numbers are one token per digit here as
    # in the character tokenizer, so the positions where the sums are decided align one to one, while words,
    # ' ####' and ' ans' still merge with the space before them
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split(" ", "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=chars.SPECIAL_TOKENS,  # ids 0, 1, 2, as in the character tokenizer
        initial_alphabet=byte_level_alphabet(chars.CHARACTERS),
        show_progress=False,
    )
    core.train_from_iterator(texts if texts is not None else demo_texts(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=chars.PAD,
        eos_token=chars.EOS,
        unk_token=chars.UNK,
        chat_template=chars.CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def compare(bpe, char, path: Path = TEST_PROMPTS) -> dict:
    """Tokens per held-out prompt and answer under both tokenizers, and how each splits one answer."""
    texts = demo_texts(path)
    prompts = [t[: t.index("\n") + 1] for t in texts[::2]]
    answers = [t[t.index("\n") + 1 :] for t in texts[::2]]

    def mean_tokens(tokenizer, strings):
        return sum(len(ids) for ids in tokenizer(strings, add_special_tokens=False)["input_ids"]) / len(strings)

    example = " #### 85"
    return {
        "bpe_vocab": len(bpe),
        "char_vocab": len(char),
        "prompt_tokens": {"bpe": mean_tokens(bpe, prompts), "char": mean_tokens(char, prompts)},
        "answer_tokens": {"bpe": mean_tokens(bpe, answers), "char": mean_tokens(char, answers)},
        "split": {
            "bpe": bpe.convert_ids_to_tokens(bpe(example, add_special_tokens=False)["input_ids"]),
            "char": char.convert_ids_to_tokens(char(example, add_special_tokens=False)["input_ids"]),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: data/tokenizer_bpe)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args()
    tokenizer = build_tokenizer(args.vocab_size)
    tokenizer.save_pretrained(args.out)
    from opd_cache.tokenizer import load_tokenizer

    report = compare(load_tokenizer(args.out), load_tokenizer(DATA / "tokenizer"))
    print(f"wrote {args.out}: {report['bpe_vocab']} tokens (the character tokenizer: {report['char_vocab']})")
    for key in ("prompt_tokens", "answer_tokens"):
        print(
            f"  {key.replace('_', ' ')} per held-out row: bpe {report[key]['bpe']:.2f}, char {report[key]['char']:.2f}"
        )
    print(f"  ' #### 85' is {report['split']['bpe']} in bpe, {report['split']['char']} in char")


if __name__ == "__main__":
    main()
