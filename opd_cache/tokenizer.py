"""Loading tokenizers, fingerprinting them, and checking that a teacher and a student share one.

Distillation compares the teacher's and the student's distributions token id by
token id, so both must map every id to the same string. Every shard carries a
`tokenizer_fingerprint` (a hash of the vocabulary and the special tokens), and a
stage refuses shards whose fingerprint differs from its own tokenizer's.
"""

from __future__ import annotations

import hashlib
import json
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# The special-token attributes that change what ids mean (for padding, stopping, unknown text).
_SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "pad_token", "unk_token")


def load_tokenizer(
    path: str | os.PathLike,
    trust_remote_code: bool = False,
    padding_side: str | None = None,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model folder (or a hub id, for users with a hub).

    A folder with a `tokenizer.json` is loaded with `PreTrainedTokenizerFast`
    directly: with transformers 5, `AutoTokenizer` reads a `config.json` beside
    it and may pick another class for the model type. `padding_side` overrides
    the saved one (generation wants "left").
    """
    path = os.fspath(path)
    kwargs = {} if padding_side is None else {"padding_side": padding_side}
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        raise ValueError(f"tokenizer {path}: the folder has neither tokenizer.json nor tokenizer_config.json")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)


def _id_to_token(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    # get_vocab() includes the added (special) tokens.
    return {i: token for token, i in tokenizer.get_vocab().items()}


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, str | None]:
    return {name: getattr(tokenizer, name, None) for name in _SPECIAL_ATTRIBUTES}


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short sha256 hex digest of the vocabulary (token → id) and the special tokens.

    Padding side, chat template and model_max_length do not change it: they do
    not change what an id means.
    """
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
        "special": _special_tokens(tokenizer),
    }
    blob = json.dumps(payload, ensure_ascii=True, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def first_vocab_difference(
    tok_a: PreTrainedTokenizerBase,
    tok_b: PreTrainedTokenizerBase,
    name_a: str = "A",
    name_b: str = "B",
) -> str | None:
    """Describe the first difference between two tokenizers, or return None if they agree.

    For example: "id 17 is 'a' in A but 'b' in B".
    """
    vocab_a, vocab_b = _id_to_token(tok_a), _id_to_token(tok_b)
    for i in sorted(vocab_a.keys() | vocab_b.keys()):
        a, b = vocab_a.get(i), vocab_b.get(i)
        if a != b:
            shown_a = "absent" if a is None else repr(a)
            shown_b = "absent" if b is None else repr(b)
            return f"id {i} is {shown_a} in {name_a} but {shown_b} in {name_b}"
    special_a, special_b = _special_tokens(tok_a), _special_tokens(tok_b)
    for name in _SPECIAL_ATTRIBUTES:
        if special_a[name] != special_b[name]:
            return f"{name} is {special_a[name]!r} in {name_a} but {special_b[name]!r} in {name_b}"
    return None


def check_compatible(
    student_tok: PreTrainedTokenizerBase,
    teacher_tok: PreTrainedTokenizerBase,
    teacher_vocab_size: int,
    student_name: str = "student",
    teacher_name: str = "teacher",
    student_vocab_size: int | None = None,
) -> None:
    """Raise ValueError unless teacher and student share one tokenizer and their models cover it.

    `*_vocab_size` is the model's embedding size (config.vocab_size). It may be
    padded beyond the tokenizer (e.g. to a multiple of 64); a tokenizer with
    ids beyond the embedding is an error, since those ids cannot be scored.
    """
    difference = first_vocab_difference(teacher_tok, student_tok, teacher_name, student_name)
    if difference is not None:
        raise ValueError(f"teacher {teacher_name} and student {student_name} tokenizers differ: {difference}")
    for role, name, vocab_size in (
        ("teacher", teacher_name, teacher_vocab_size),
        ("student", student_name, student_vocab_size),
    ):
        if vocab_size is not None and len(teacher_tok) > vocab_size:
            raise ValueError(
                f"{role} {name}: the tokenizer has {len(teacher_tok)} tokens but the model's embedding has only "
                f"{vocab_size} rows (ids >= {vocab_size} cannot be scored)"
            )
