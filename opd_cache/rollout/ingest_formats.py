"""The JSONL rows `opd ingest` reads, and how each becomes token ids, a loss mask and a turn index.

One JSON object per line, in one of these shapes (the first that matches):

| shape | fields | becomes |
|---|---|---|
| token ids (any producer) | `prompt_ids`, `response_ids`; optional `loss_mask`, `turn_index`, `behavior_logprobs`, `finish_reason` | used as given |
| OpenAI chat / TRL conversational | `messages` (roles system/user/assistant/tool, `tool_calls`, `weight` 0/1), optional `tools` | rendered with the student's chat template (rollout/conversation.py) |
| TRL conversational prompt-completion | `prompt` and `completion`, both message lists | the same, messages = prompt + completion |
| TRL standard prompt-completion | `prompt` and `completion`, both text | prompt encoded as text (the tokenizer's BOS added), completion + EOS |
| verl rollout dump (`trainer.rollout_data_dir`) | `input`, `output` text, `step`, `gts` | as the standard form; version = `step` - 1 |

Every shape may also carry `policy_version` (the version that sampled the row; else `--policy-version`),
`data_source`, `ground_truth` (verl: `gts`, or `reward_model.ground_truth`), `extra_info` (kept as JSON in
`extra`), `prompt_index` and `sample_index`. Text rows have no behavior log-probs: opd_cache/rollout/ingest.py
computes them. verl decodes its dumps with `skip_special_tokens=True`, so the template's special tokens are not
in `input`: such rows are re-tokenized text, not the ids verl sampled.

`parse_line(obj, where, context) -> PendingRow`; every problem is an `IngestError` whose message starts with
`where` ("rows.jsonl:12").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from opd_cache.rollout.conversation import ChatRenderer, TemplateError, render_conversation
from opd_cache.rollout.messages import Message, MessageError, check_conversation, tool_names_of


class IngestError(ValueError):
    """A row `opd ingest` cannot write (the message names the file and line)."""


@dataclass
class IngestContext:
    """What converting a row needs: the student's tokenizer, the chat template, the known tools."""

    tokenizer: Any
    chat_template: str | None = None  # None: the tokenizer's own
    tools: set[str] | None = None  # tool names known for rows without a `tools` list
    default_version: int | None = None


@dataclass
class PendingRow:
    """A row converted to tokens, before its log-probs (None when they must be computed) are known."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behavior_logprobs: np.ndarray | None
    loss_mask: np.ndarray | None
    turn_index: np.ndarray | None
    policy_version: int
    finish_reason: str = "stop"
    prompt_index: int | None = None
    sample_index: int = 0
    data_source: str | None = None
    ground_truth: str | None = None
    extra: str | None = None

    def writer_fields(self) -> dict:
        """The keyword arguments of RolloutWriter.append besides ids and log-probs: every other field by name."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _ROW_ARRAYS_AND_VERSION
        }


# PendingRow fields that RolloutWriter.append takes positionally (the arrays) or per shard (the version).
_ROW_ARRAYS_AND_VERSION = ("prompt_ids", "response_ids", "behavior_logprobs", "policy_version")


def parse_line(obj: Any, where: str, context: IngestContext) -> PendingRow:
    """One JSONL object as a PendingRow (module docstring); IngestError names `where` and the problem."""
    if not isinstance(obj, dict):
        raise IngestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    try:
        if "response_ids" in obj or "prompt_ids" in obj:
            tokens = _token_row(obj, where)
        elif "messages" in obj:
            tokens = _conversation_row(obj, obj["messages"], where, context)
        elif "prompt" in obj and "completion" in obj:
            if isinstance(obj["prompt"], list) and isinstance(obj["completion"], list):
                tokens = _conversation_row(obj, obj["prompt"] + obj["completion"], where, context)
            elif isinstance(obj["prompt"], str) and isinstance(obj["completion"], str):
                tokens = _text_row(obj["prompt"], obj["completion"], context)
            else:
                raise IngestError(f"{where}: 'prompt' and 'completion' must both be text or both message lists")
        elif "input" in obj and "output" in obj:
            if not isinstance(obj["input"], str) or not isinstance(obj["output"], str):
                raise IngestError(f"{where}: verl's 'input' and 'output' must be text")
            tokens = _text_row(obj["input"], obj["output"], context)
        else:
            raise IngestError(
                f"{where}: no row found: expected 'prompt_ids'+'response_ids', 'messages', 'prompt'+'completion' "
                f"or verl's 'input'+'output'"
            )
    except (MessageError, TemplateError) as e:
        raise IngestError(f"{where}: {e}") from None
    return PendingRow(**tokens, policy_version=_version(obj, where, context), **_passthrough(obj, where))


def _token_row(obj: dict, where: str) -> dict:
    for name in ("prompt_ids", "response_ids"):
        if not isinstance(obj.get(name), list):
            raise IngestError(f"{where}: '{name}' must be a list of token ids")
    arrays = {}
    for name in ("prompt_ids", "response_ids", "loss_mask", "turn_index", "behavior_logprobs"):
        value = obj.get(name)
        if value is None:
            arrays[name] = None
            continue
        if not isinstance(value, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            raise IngestError(f"{where}: '{name}' must be a list of numbers")
        integer = name != "behavior_logprobs"
        if integer and not all(float(v).is_integer() for v in value):
            raise IngestError(f"{where}: '{name}' must hold integers")
        arrays[name] = np.asarray(value, dtype=np.int64 if integer else np.float64)
    finish = obj.get("finish_reason", "stop")
    return dict(**arrays, finish_reason=finish)


def _conversation_row(obj: dict, raw_messages: Any, where: str, context: IngestContext) -> dict:
    if not isinstance(raw_messages, list):
        raise IngestError(f"{where}: 'messages' must be a list of messages")
    messages = [Message.from_dict(m, f"message {i}") for i, m in enumerate(raw_messages)]
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise IngestError(f"{where}: 'tools' must be a list of tool definitions")
    known = tool_names_of(tools) if tools is not None else context.tools
    calls = [call.name for m in messages for call in m.tool_calls]
    if calls and known is None:
        raise IngestError(
            f"{where}: calls tool {calls[0]!r} but declares no tools (give the row a 'tools' list, or --tools)"
        )
    check_conversation(messages, tool_names=known)
    renderer = ChatRenderer(context.tokenizer, context.chat_template, tools=tools)
    row = render_conversation(renderer, messages)
    return dict(
        prompt_ids=row.prompt_ids,
        response_ids=row.response_ids,
        loss_mask=row.loss_mask,
        turn_index=row.turn_index,
        behavior_logprobs=None,
        finish_reason="stop",
    )


def _text_row(prompt: str, completion: str, context: IngestContext) -> dict:
    tokenizer = context.tokenizer
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    response_ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    return dict(
        prompt_ids=np.asarray(prompt_ids, dtype=np.int64),
        response_ids=np.asarray(response_ids, dtype=np.int64),
        loss_mask=None,
        turn_index=None,
        behavior_logprobs=None,
        finish_reason="stop",
    )


def _version(obj: dict, where: str, context: IngestContext) -> int:
    version = obj.get("policy_version")
    if version is None and "step" in obj and "input" in obj:  # verl: the rollout of step s used the weights of s-1
        version = obj["step"] - 1 if isinstance(obj["step"], int) else obj["step"]
    if version is None:
        version = context.default_version
    if version is None:
        raise IngestError(f"{where}: no policy version: give --policy-version (or 'policy_version' in the row)")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise IngestError(f"{where}: policy_version must be an integer >= 0, got {version!r}")
    return version


def _passthrough(obj: dict, where: str) -> dict:
    ground_truth = obj.get("ground_truth", obj.get("gts"))
    reward_model = obj.get("reward_model")
    if ground_truth is None and isinstance(reward_model, dict):
        ground_truth = reward_model.get("ground_truth")
    extra = obj.get("extra", obj.get("extra_info"))
    fields = dict(
        data_source=obj.get("data_source"),
        ground_truth=None if ground_truth is None else str(ground_truth),
        extra=None if extra is None else extra if isinstance(extra, str) else json.dumps(extra, sort_keys=True),
        prompt_index=obj.get("prompt_index"),
        sample_index=obj.get("sample_index", 0),
    )
    for name in ("prompt_index", "sample_index"):
        value = fields[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise IngestError(f"{where}: '{name}' must be an integer >= 0, got {value!r}")
    if fields["data_source"] is not None and not isinstance(fields["data_source"], str):
        raise IngestError(f"{where}: 'data_source' must be text")
    return fields
