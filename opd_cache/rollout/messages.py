"""Chat messages with tool calls: the typed form every multi-turn module works with.

A conversation is a list of `Message`s (roles system, user, assistant, tool). An assistant message may carry
`ToolCall`s; a tool message answers one. `Message.from_dict` reads the OpenAI chat format (also what TRL's
conversational datasets and Hugging Face chat templates use) strictly: an unknown role, a malformed tool call or
a non-text content part is an error naming where it is. `Message.to_template` gives the dict a Hugging Face chat
template renders (tool-call arguments as an object, or as text for free-form tools like the demo's calculator).

    Message.from_dict({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"expression\": \"37+48\"}"}}]})
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# Other names producers use for the same roles: OpenAI's "developer" is its system role, Llama 3's "ipython"
# carries tool results.
ROLE_ALIASES = {"developer": "system", "ipython": "tool"}


class MessageError(ValueError):
    """A message or conversation that cannot be rendered or trained (the text names the message and field)."""


@dataclass
class ToolCall:
    """One call of a tool by the assistant."""

    name: str
    arguments: dict[str, Any] | str  # a JSON object (function tools) or free-form text (the demo's "37+48")
    id: str | None = None

    def to_template(self) -> dict[str, Any]:
        call: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call

    @classmethod
    def from_dict(cls, value: Any, where: str) -> ToolCall:
        """An OpenAI tool call `{"id", "type": "function", "function": {"name", "arguments"}}` (or the flat
        `{"name", "arguments"}` some producers write). String arguments that hold a JSON object are parsed."""
        if not isinstance(value, dict):
            raise MessageError(f"{where}: a tool call must be an object, got {type(value).__name__}")
        function = value.get("function", value)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise MessageError(f"{where}: a tool call needs a function name ('function': {{'name': ...}})")
        arguments = function.get("arguments", function.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None  # free-form text arguments (a custom tool's input)
            if isinstance(parsed, dict):
                arguments = parsed
        elif not isinstance(arguments, dict):
            raise MessageError(
                f"{where}: tool call {function['name']!r} has arguments of type {type(arguments).__name__}, "
                f"expected an object or a string"
            )
        call_id = value.get("id")
        return cls(name=function["name"], arguments=arguments, id=str(call_id) if call_id is not None else None)


@dataclass
class Message:
    """One message of a conversation."""

    role: str  # one of ROLES
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers
    name: str | None = None  # tool messages: the tool's name
    trained: bool = True  # assistant messages: False = context only (OpenAI fine-tuning's "weight": 0)
    parse_error: str | None = None  # assistant messages parsed from model output: why its tool call did not parse

    def to_template(self) -> dict[str, Any]:
        """The dict a Hugging Face chat template renders (keys only where they hold something)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    @classmethod
    def from_dict(cls, value: Any, where: str) -> Message:
        """A message in the OpenAI chat format; `where` names it in errors (e.g. "rows.jsonl:3: message 2")."""
        if isinstance(value, Message):
            return value
        if not isinstance(value, dict):
            raise MessageError(f"{where}: a message must be an object with 'role' and 'content'")
        role = value.get("role")
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise MessageError(f"{where}: unknown role {value.get('role')!r} (expected one of {', '.join(ROLES)})")
        content = _content_text(value.get("content"), where)
        calls = value.get("tool_calls") or []
        if calls and role != "assistant":
            raise MessageError(f"{where}: a {role} message has tool_calls (only assistant messages call tools)")
        if not isinstance(calls, list):
            raise MessageError(f"{where}: 'tool_calls' must be a list")
        weight = value.get("weight", 1)
        if weight not in (0, 1):
            raise MessageError(f"{where}: 'weight' must be 0 or 1, got {weight!r}")
        return cls(
            role=role,
            content=content,
            tool_calls=[ToolCall.from_dict(c, f"{where}: tool call {i}") for i, c in enumerate(calls)],
            tool_call_id=value.get("tool_call_id"),
            name=value.get("name") if role == "tool" else None,
            trained=role == "assistant" and weight == 1,
        )


def _content_text(content: Any, where: str) -> str:
    """Text content: a string, null, or a list of text parts (the OpenAI multi-part form)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessageError(f"{where}: content part of type {kind!r} (only text parts can be trained on)")
        return "".join(texts)
    raise MessageError(f"{where}: 'content' must be text, got {type(content).__name__}")


def check_conversation(messages: list[Message], where: str = "", tool_names: set[str] | None = None) -> None:
    """A conversation that can become a training row: a context before the first assistant turn, at least one
    trained assistant turn, tool messages only answering tool calls, and (when `tool_names` is given) calls only
    to those tools. `where` prefixes the error messages (e.g. "rows.jsonl:3")."""
    where = f"{where}: " if where else ""
    if not messages:
        raise MessageError(f"{where}the conversation has no messages")
    if messages[0].role == "assistant":
        raise MessageError(
            f"{where}message 0 is an assistant turn; a conversation starts with a system or user message"
        )
    if not any(m.role == "assistant" and m.trained for m in messages):
        raise MessageError(f"{where}no assistant message to train on (none, or all with weight 0)")
    previous = None
    for i, message in enumerate(messages):
        if message.role == "tool" and not (previous is not None and (previous.role == "tool" or previous.tool_calls)):
            raise MessageError(f"{where}message {i} is a tool result that follows no tool call")
        for call in message.tool_calls:
            if tool_names is not None and call.name not in tool_names:
                known = ", ".join(sorted(tool_names)) or "none"
                raise MessageError(f"{where}message {i} calls unknown tool {call.name!r} (known tools: {known})")
        previous = message


def tool_names_of(tools: list[dict] | None) -> set[str] | None:
    """The names of OpenAI-style tool definitions (`{"type": "function", "function": {"name": ...}}`)."""
    if tools is None:
        return None
    names = set()
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise MessageError(f"tool definition {tool!r} has no function name")
        names.add(function["name"])
    return names
