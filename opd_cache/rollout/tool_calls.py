"""Tool calls in the model's own output: each chat template writes them its own way, and this parses them back.

Three formats, each the inverse of how its templates render an assistant message with `tool_calls`:

- `hermes` (Qwen2.5/Qwen3, Hermes, many others): content, then one block per call,
  `<tool_call>\\n{"name": "calc", "arguments": {"expression": "37+48"}}\\n</tool_call>`.
- `llama` (Llama 3.1/3.3 JSON tool calling): the whole message is the call,
  `{"name": "calc", "parameters": {"expression": "37+48"}}`, optionally after `<|python_tag|>`; several calls
  are separated by `;`.
- `demo` (data/chat_templates/arithmetic_tools.jinja, made for the character-level demo tokenizer, whose
  alphabet is printable ASCII): content, then `[name(input)]` per call, the input free-form text, as in
  `[calc(37+48)]`. Short on purpose: every character is a token the tiny demo student has to produce.

`parse_assistant_text(text, fmt)` returns the assistant `Message` (content + tool calls) or raises
`ToolCallError` saying what is wrong (unterminated block, invalid JSON, no name, text after the calls). A chat
template names its format in a comment `tool_call_format: NAME`, or it is recognised by its markers
(`detect_tool_call_format`).
"""

from __future__ import annotations

import json
import re

from opd_cache.rollout.messages import Message, ToolCall

FORMATS = ("hermes", "llama", "demo")


class ToolCallError(ValueError):
    """Model output that tries to call a tool but does not parse (the message says where and why)."""


def detect_tool_call_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template renders: declared (`tool_call_format: NAME` in a comment) or
    recognised by its markers; None when the template renders no tool calls this module knows."""
    if not chat_template:
        return None
    declared = re.search(r"tool_call_format:\s*([a-z]+)", chat_template)
    if declared:
        if declared.group(1) not in FORMATS:
            raise ValueError(f"chat template declares tool_call_format {declared.group(1)!r}; known: {FORMATS}")
        return declared.group(1)
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama"
    return None


def parse_assistant_text(text: str, fmt: str) -> Message:
    """The assistant message that `text` (the model's output, end-of-turn token removed) stands for."""
    if fmt == "hermes":
        content, calls = _parse_hermes(text)
    elif fmt == "llama":
        content, calls = _parse_llama(text)
    elif fmt == "demo":
        content, calls = _parse_demo(text)
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}: use one of {', '.join(FORMATS)}")
    return Message(role="assistant", content=content, tool_calls=calls)


def _call_from_json(blob: str, what: str, argument_keys: tuple[str, ...]) -> ToolCall:
    try:
        value = json.loads(blob)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{what} is not valid JSON ({e.msg} at character {e.pos}): {_short(blob)}") from None
    if not isinstance(value, dict):
        raise ToolCallError(f"{what} must be a JSON object, got {_short(blob)}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError(f'{what} has no "name": {_short(blob)}')
    arguments = next((value[k] for k in argument_keys if k in value), {})
    if not isinstance(arguments, (dict, str)):
        raise ToolCallError(f"{what}: arguments of {name!r} must be an object, got {_short(json.dumps(arguments))}")
    return ToolCall(name=name, arguments=arguments)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    first = text.find("<tool_call>")
    if first < 0:
        if "</tool_call>" in text:
            raise ToolCallError("</tool_call> without an opening <tool_call>")
        return text, []
    calls, end = [], first
    for i, block in enumerate(_HERMES_BLOCK.finditer(text, first)):
        if text[end : block.start()].strip():
            raise ToolCallError(f"text between tool calls: {_short(text[end : block.start()])}")
        calls.append(_call_from_json(block.group(1).strip(), f"<tool_call> block {i}", ("arguments", "parameters")))
        end = block.end()
    rest = text[end:]
    if "<tool_call>" in rest:
        raise ToolCallError(f"<tool_call> block {len(calls)} is not closed with </tool_call>: {_short(rest)}")
    if rest.strip():
        raise ToolCallError(f"text after the tool calls: {_short(rest)}")
    return text[:first].rstrip("\n"), calls


_LLAMA_CALL_START = re.compile(r'^\s*(?:<\|python_tag\|>)?\s*\{\s*"name"')


def _parse_llama(text: str) -> tuple[str, list[ToolCall]]:
    if not _LLAMA_CALL_START.match(text):
        return text, []  # plain content
    body = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            _, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError as e:
            raise ToolCallError(
                f"tool call {len(calls)} is not valid JSON ({e.msg} at character {e.pos}): {_short(body[position:])}"
            ) from None
        calls.append(_call_from_json(body[position:end], f"tool call {len(calls)}", ("parameters", "arguments")))
        position = end
        separator = re.match(r"\s*;?\s*", body[position:])
        position += separator.end()
        if position < len(body) and not separator.group(0).strip():
            raise ToolCallError(f"text after tool call {len(calls) - 1}: {_short(body[position:])}")
    return "", calls


_DEMO_CALL = re.compile(r"\[([A-Za-z_][A-Za-z0-9_]*)\((.*?)\)\]", re.DOTALL)
_DEMO_OPEN = re.compile(r"\[[A-Za-z_][A-Za-z0-9_]*\(")


def _parse_demo(text: str) -> tuple[str, list[ToolCall]]:
    opened = _DEMO_OPEN.search(text)
    if opened is None:
        return text, []
    calls, end = [], opened.start()
    for call in _DEMO_CALL.finditer(text, opened.start()):
        if text[end : call.start()].strip():
            raise ToolCallError(f"text between tool calls: {_short(text[end : call.start()])}")
        calls.append(ToolCall(name=call.group(1), arguments=call.group(2)))
        end = call.end()
    rest = text[end:]
    if _DEMO_OPEN.search(rest):
        raise ToolCallError(f"tool call {len(calls)} is not closed with ')]': {_short(rest)}")
    if rest.strip():
        raise ToolCallError(f"text after the tool calls: {_short(rest)}")
    return text[: opened.start()], calls


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
