"""Build the tiny character-level tokenizer shipped in data/tokenizer/.

One token per character: the special tokens first (`<pad>` is id 0), then
newline, then the 95 printable ASCII characters in code-point order. Nothing
is normalised, stripped or merged, so `decode(encode(text)) == text` for any
printable-ASCII text, and the id of a character never depends on its
neighbours. The output is deterministic: running this script again writes the
same vocabulary (and so the same tokenizer fingerprint).

The chat template renders each user (or system) message as its text plus a
newline; an assistant message is its text plus `<eos>`. The assistant's turn
starts right after the newline, so the arithmetic prompt "What is 37 + 48?"
becomes the 17 characters "What is 37 + 48?\\n" and the model answers
" #### 85<eos>".

    python data/make_tokenizer.py            # writes data/tokenizer/
    python data/make_tokenizer.py --out DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]
CHARACTERS = ["\n"] + [chr(c) for c in range(0x20, 0x7F)]  # newline + printable ASCII

CHAT_TEMPLATE = r"""{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {{- message['content'] + eos_token -}}
    {%- else -%}
        {{- message['content'] + '\n' -}}
    {%- endif -%}
{%- endfor -%}
{#- add_generation_prompt adds nothing: the assistant's turn starts right after the newline. -#}
"""

DEFAULT_OUT = Path(__file__).resolve().parent / "tokenizer"


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split into single characters ([\s\S] also matches the newline, which "." would not).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate characters, no spaces in between
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: data/tokenizer)")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {len(tokenizer)} tokens")


if __name__ == "__main__":
    main()
