"""Prompt datasets: read prompts from a file, apply the chat template, return token ids.

Two row formats are understood:

- verl's preprocessed format (what verl's `examples/data_preprocess/*.py` write):
  `prompt` = a list of chat messages `[{"role": "user", "content": ...}]`,
  `data_source` (which reward function), `reward_model.ground_truth`,
  `extra_info` (anything else).
- plain `question` / `answer` (GSM8K's own columns): the question becomes one
  user message; the `#### N` part of the answer (or the whole answer when it
  has no `####`) becomes the ground truth.

Files: parquet, JSONL (or a JSON array), a folder written by
`datasets.Dataset.save_to_disk`, or any other local folder `datasets.load_dataset`
reads (e.g. a folder of parquet files). Parquet and JSONL files may also be
pyarrow.fs URIs (s3://…).

Every prompt is rendered with `tokenizer.apply_chat_template(...,
add_generation_prompt=True)` and tokenized without adding special tokens again
(the template has them), as verl does. Bad rows are refused with a one-line
error naming the file and row.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from opd_cache.tasks.rewards import strict_answer

logger = logging.getLogger(__name__)

# The columns of verl's preprocessed prompt parquet that this package writes (data/make_arithmetic.py,
# data/prepare_gsm8k.py). `extra_info` is free-form, so its type is inferred per file.
VERL_PROMPT_FIELDS = [
    pa.field("data_source", pa.string()),
    pa.field("prompt", pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))),
    pa.field("ability", pa.string()),
    pa.field("reward_model", pa.struct([pa.field("ground_truth", pa.string()), pa.field("style", pa.string())])),
]


def verl_prompt_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows in verl's format → an Arrow table with the declared column types (extra_info inferred)."""
    columns = {f.name: pa.array([row[f.name] for row in rows], type=f.type) for f in VERL_PROMPT_FIELDS}
    columns["extra_info"] = pa.array([row.get("extra_info") for row in rows])
    return pa.table(columns)


@dataclass
class PromptSet:
    """Tokenized prompts and what travels with them into the rollout shards."""

    prompt_ids: list[list[int]]
    data_source: list[str | None]
    ground_truth: list[str | None]
    extra: list[str | None]  # a JSON string per row (verl's extra_info), or None
    row_index: list[int]  # each prompt's row in the source file (rows may have been skipped)
    source: str = ""
    num_skipped_too_long: int = 0
    messages: list[list[dict[str, str]]] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def to_arrow(self) -> pa.Table:
        return pa.table(
            {
                "prompt_ids": pa.array(self.prompt_ids, type=pa.list_(pa.int32())),
                "data_source": pa.array(self.data_source, type=pa.string()),
                "ground_truth": pa.array(self.ground_truth, type=pa.string()),
                "extra": pa.array(self.extra, type=pa.string()),
                "row_index": pa.array(self.row_index, type=pa.int64()),
            }
        )


# ---------------------------------------------------------------- reading files into columns
def _read_bytes(path: str) -> bytes:
    if "://" in path:
        from opd_cache.storage.store import Store

        parent, _, name = path.rpartition("/")
        return Store(parent).read_bytes(name)
    with open(path, "rb") as f:
        return f.read()


def _read_jsonl(path: str, data: bytes) -> list[dict]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"prompts file {path}: line {line} is not valid UTF-8 (byte {e.start})") from None
    if text.lstrip().startswith("["):  # a JSON array rather than JSON lines
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts file {path}: not a valid JSON array (line {e.lineno}: {e.msg})") from None
    else:
        rows = []
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"prompts file {path}: line {line_number} is not valid JSON ({e.msg})") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"prompts file {path}: row {i} is a {type(row).__name__}, expected a JSON object")
    return rows


def _rows_to_columns(rows: list[dict]) -> dict[str, list]:
    names = list(dict.fromkeys(name for row in rows for name in row))
    return {name: [row.get(name) for row in rows] for name in names}


def _read_dataset_folder(path: str, split: str | None) -> dict[str, list]:
    import datasets

    saved = any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))
    try:
        data = datasets.load_from_disk(path) if saved else datasets.load_dataset(path)
    except RuntimeError as e:  # e.g. a folder holding a loading script, which datasets >= 4 refuses to run
        raise ValueError(f"prompts {path}: not readable as a dataset folder ({e})") from None
    if isinstance(data, datasets.DatasetDict):
        if split is None and len(data) == 1:
            split = next(iter(data))
        if split not in data:
            raise ValueError(f"prompts {path} has splits {sorted(data)}: pass split= to choose one")
        data = data[split]
    return data.to_dict()


def check_prompts_path(path: str | os.PathLike) -> None:
    """A local prompt file must exist (the commands call this before any model loads)."""
    path = os.fspath(path)
    if "://" not in path and not os.path.exists(path):
        raise ValueError(f"prompts file {path} does not exist")


def read_columns(path: str | os.PathLike, split: str | None = None) -> dict[str, list]:
    """The rows of a prompt file as {column: list of Python values}."""
    path = os.fspath(path)
    check_prompts_path(path)
    if "://" not in path and os.path.isdir(path):
        return _read_dataset_folder(path, split)
    if path.endswith(".parquet"):
        data = _read_bytes(path)
        try:
            return pq.read_table(pa.BufferReader(data)).to_pydict()
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"prompts file {path}: not a readable parquet file ({e})") from None
    if path.endswith((".jsonl", ".json")):
        return _rows_to_columns(_read_jsonl(path, _read_bytes(path)))
    raise ValueError(f"prompts file {path}: unknown format; expected .parquet, .jsonl, .json or a datasets folder")


# ---------------------------------------------------------------- rows → messages and metadata
def _as_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _as_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, default=str)


def _check_messages(path: str, row: int, column: str, value: Any) -> list[dict[str, str]]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )
    if not ok:
        raise ValueError(
            f"prompts file {path}: row {row}: column {column!r} must be a list of chat messages "
            f"{{'role': str, 'content': str}}, got {str(value)[:80]!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _prompt_column(path: str, columns: dict[str, list], prompt_key: str | None) -> str:
    found = ", ".join(columns) or "none"
    if prompt_key is not None:
        if prompt_key not in columns:
            raise ValueError(f"prompts file {path}: prompt_key {prompt_key!r} is not a column; found columns: {found}")
        return prompt_key
    for name in ("prompt", "question"):
        if name in columns:
            return name
    raise ValueError(
        f"prompts file {path}: missing column 'prompt' (verl chat messages) or 'question' (plain text); "
        f"found columns: {found}"
    )


def _ground_truths(path: str, columns: dict[str, list], n: int) -> list[str | None]:
    if "reward_model" in columns:
        truths = []
        for i, reward_model in enumerate(columns["reward_model"]):
            if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
                keys = sorted(reward_model) if isinstance(reward_model, dict) else type(reward_model).__name__
                raise ValueError(f"prompts file {path}: row {i}: reward_model has no 'ground_truth' (found: {keys})")
            truths.append(_as_text(reward_model["ground_truth"]))
        return truths
    if "answer" in columns:
        # GSM8K answers are a worked solution ending in "#### N": N is the ground truth.
        return [None if a is None else (strict_answer(str(a)) or str(a).strip()) for a in columns["answer"]]
    return [None] * n


def _extras(columns: dict[str, list], n: int) -> list[str | None]:
    extra_info = columns.get("extra_info", [None] * n)
    if "reward_model" in columns or "answer" not in columns:
        return [_as_json(e) for e in extra_info]
    # Plain question/answer rows: keep the full answer (e.g. GSM8K's worked solution) beside extra_info.
    return [_as_json({**(e or {}), "answer": a}) for e, a in zip(extra_info, columns["answer"])]


# ---------------------------------------------------------------- the public entry point
def load_prompts(
    path: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_tokens: int | None = None,
    truncate: bool = False,
    prompt_key: str | None = None,
    split: str | None = None,
) -> PromptSet:
    """Read, template and tokenize a prompt dataset.

    `max_prompt_tokens` limits the templated prompt's length: a longer prompt
    is an error, or with `truncate=True` is skipped and counted
    (`PromptSet.num_skipped_too_long`). `prompt_key` names the prompt column
    when it is neither `prompt` nor `question`. `split` picks a split of a
    datasets folder that has several.
    """
    path = os.fspath(path)
    columns = read_columns(path, split)
    key = _prompt_column(path, columns, prompt_key)
    n = len(columns[key])
    if n == 0:
        raise ValueError(f"prompts file {path} has no rows")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    tokenizer_name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__

    # 1. Every row becomes a list of chat messages (plain text becomes one user message).
    is_chat = any(isinstance(v, list) for v in columns[key])
    if is_chat and not has_template:
        raise ValueError(
            f"prompts file {path}: column {key!r} holds chat messages but tokenizer {tokenizer_name} has no "
            f"chat template; use a chat/instruct tokenizer, or plain-text prompts in a 'question' column"
        )
    messages = []
    for i, value in enumerate(columns[key]):
        if is_chat:
            conversation = _check_messages(path, i, key, value)
        elif isinstance(value, str):
            conversation = [{"role": "user", "content": value}]
        else:
            raise ValueError(f"prompts file {path}: row {i}: column {key!r} must be text, got {value!r}")
        if not any(m["content"].strip() for m in conversation):
            raise ValueError(f"prompts file {path}: row {i}: prompt is empty (no text in column {key!r})")
        messages.append(conversation)

    # 2. Template and tokenize in one batch. Without a chat template, plain text is tokenized as it is,
    #    with the tokenizer's own special tokens (e.g. BOS) as a base model expects.
    if has_template:
        texts = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer([m[0]["content"] for m in messages], add_special_tokens=True)["input_ids"]
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"prompts file {path}: row {i}: prompt is empty (0 tokens after the chat template)")

    # 3. Enforce the length limit: refuse, or skip and count.
    keep = list(range(n))
    if max_prompt_tokens is not None:
        too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) > max_prompt_tokens]
        if too_long and not truncate:
            i = too_long[0]
            raise ValueError(
                f"prompts file {path}: row {i}: prompt has {len(prompt_ids[i])} tokens, more than "
                f"max_prompt_tokens={max_prompt_tokens} ({len(too_long)} rows are too long; "
                f"truncate=True / --truncate-prompts skips them)"
            )
        if too_long:
            logger.warning(
                "prompts file %s: skipped %d of %d prompts longer than %d tokens",
                path,
                len(too_long),
                n,
                max_prompt_tokens,
            )
            skip = set(too_long)
            keep = [i for i in keep if i not in skip]
        if not keep:
            raise ValueError(
                f"prompts file {path}: all {n} prompts are longer than max_prompt_tokens={max_prompt_tokens}"
            )

    data_sources = [_as_text(v) for v in columns.get("data_source", [None] * n)]
    ground_truths = _ground_truths(path, columns, n)
    extras = _extras(columns, n)
    return PromptSet(
        prompt_ids=[prompt_ids[i] for i in keep],
        data_source=[data_sources[i] for i in keep],
        ground_truth=[ground_truths[i] for i in keep],
        extra=[extras[i] for i in keep],
        row_index=keep,
        source=path,
        num_skipped_too_long=n - len(keep),
        messages=[messages[i] for i in keep],
    )
