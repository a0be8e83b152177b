"""Build the demo's second tokenizer: a small byte-level BPE, written to data/tokenizer_bpe/.

The cross-tokenizer demo (docs/cross-tokenizer.md) pairs the character-level teacher of data/models/ with a
student of another tokenizer. This one is trained with the `tokenizers` library on the demo's own text: every
training prompt as the chat template renders it, followed by both answer formats (" #### 85" and
" ans= 85"). It keeps the character tokenizer's conventions, so only the tokenization differs:

- the same special tokens with the same ids (`<pad>` 0, `<eos>` 1, `<unk>` 2) and the same chat template
  (a user message is its text plus a newline; the answer follows and ends with `<eos>`);
- GPT-2's byte-level pre-tokenizer and alphabet: all 256 bytes are tokens, so it can spell any text (the
  character tokenizer knows printable ASCII only), and words, numbers and runs of punctuation merge with the
  space before them: " #### 85" is `Ġ####` `Ġ85` here and eight characters there.

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
DEFAULT_VOCAB_SIZE = (
    400  # 256 bytes, 3 special tokens, 141 merges: the words, ' ####', ' ans', every ' NN' (' 146' is ' 14' '6')
)


def _character_tokenizer_module():
    """data/make_tokenizer.py (the character tokenizer's constants: special tokens, chat template)."""
    spec = importlib.util.spec_from_file_location("make_tokenizer", DATA / "make_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=chars.SPECIAL_TOKENS,  # ids 0, 1, 2, as in the character tokenizer
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
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
