"""A conversation with tool calls as one training row: token ids, a loss mask and a turn index per token.

The row (docs/design.md §3, "Schema version 2"; docs/agents.md):

    prompt_ids    the context up to the first trained assistant turn, its header included (what the student
                  was prompted with; the same ids `opd rollout` makes for a single-turn prompt)
    response_ids  every later token: assistant turns, the template's tokens between messages, tool results
    loss_mask     1 = a token the student sampled in an assistant turn (its content, tool calls and
                  end-of-turn token); 0 = headers, template text, tool output, untrained (weight 0) turns
    turn_index    the message each response token belongs to (its index in the message list)

Trailing untrained tokens are dropped: they would give the teacher context for nothing.

Where the tokens come from. The chat template renders the messages into text; `layout` finds, in that text,
each message's stretch and, for each assistant message, its *body*: from the end of the generation prompt
(`add_generation_prompt=True`, e.g. `<|im_start|>assistant\\n`) through the first end-of-turn token after it
(the tokenizer's EOS, or `end_of_turn`). Every stretch is encoded on its own, so no token straddles a message
boundary and the mask is exact.

- `render_conversation(renderer, messages)`: a whole conversation given as text (e.g. `opd ingest` without
  token ids); the bodies are encoded from their rendered text.
- `ConversationBuilder`: a conversation as it happens (the agent loop in opd_cache/rollout/environment.py). The
  prompt is encoded once; each assistant turn is appended as the token ids the student sampled, never
  re-encoded (re-encoding the decoded text can give other ids); after each environment step only the new text
  (the assistant's template tail, the tool messages, the next generation prompt) is encoded and appended.

Both give the same row when the sampled ids are the encoding of the body text and the template is
*incremental*: rendering the conversation so far, with the generation prompt, is a prefix of rendering the
whole conversation at every assistant turn (tests/test_conversation.py checks it for the demo, a Qwen-style and
a Llama-style template). Message boundaries use the longest common prefix of the partial and the whole
renderings, which also places messages a template renders jointly (Qwen2.5 closes consecutive tool results
with one `<|im_end|>`). A template that re-renders earlier turns once later ones exist (Qwen3 drops the
reasoning of turns before the last user message) is not incremental: for such conversations
`render_conversation` renders once and locates each assistant body by the generation prompt's offsets in the
final text (turn indices of the text between bodies then go to the first message after the previous
assistant turn). A live conversation never needs this: its token sequence is what the student saw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from opd_cache.rollout.messages import Message, MessageError, check_conversation
from opd_cache.rollout.tool_calls import ToolCallError, detect_tool_call_format, parse_assistant_text


class TemplateError(ValueError):
    """A chat template whose renderings cannot be split into messages and assistant turns."""


# ---------------------------------------------------------------- rendering text
class ChatRenderer:
    """A tokenizer plus the chat template (its own, or `chat_template`) and the tools the template renders."""

    def __init__(
        self,
        tokenizer,
        chat_template: str | None = None,
        *,
        tools: list[dict] | None = None,
        end_of_turn: tuple[str, ...] | None = None,
        tool_call_format: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise TemplateError(f"tokenizer {name} has no chat template: give one (chat_template=...)")
        self.tools = tools
        self.end_of_turn = tuple(end_of_turn or (tokenizer.eos_token,))
        if not all(self.end_of_turn):
            raise TemplateError("end_of_turn: the tokenizer has no eos_token; name the end-of-turn token(s)")
        self.tool_call_format = tool_call_format or detect_tool_call_format(self.template)

    @classmethod
    def from_file(cls, tokenizer, path: str | os.PathLike, **kwargs) -> ChatRenderer:
        """A renderer with the chat template stored in `path` (e.g. data/chat_templates/arithmetic_tools.jinja)."""
        with open(path, encoding="utf-8") as f:
            return cls(tokenizer, f.read(), **kwargs)

    def text(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(
            [m.to_template() for m in messages],
            tools=self.tools,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def encode(self, text: str) -> list[int]:
        # the template writes its special tokens itself (as `opd rollout` encodes rendered prompts)
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def parse_assistant(self, text: str) -> Message:
        """The assistant message the model's output `text` (end-of-turn token removed) stands for; a tool call
        that does not parse leaves the text as content and says why in `parse_error`."""
        if self.tool_call_format is None:
            return Message(role="assistant", content=text)
        try:
            return parse_assistant_text(text, self.tool_call_format)
        except ToolCallError as e:
            return Message(role="assistant", content=text, parse_error=str(e))


# ---------------------------------------------------------------- where each message lies in the text
@dataclass
class Layout:
    """A rendering and where its parts lie: message i is `text[starts[i]:starts[i + 1]]`; the generation
    prompt (if rendered) is `text[starts[-1]:]`; assistant message i's body is `text[a:b]`, `bodies[i] == (a, b)`."""

    text: str
    starts: list[int]
    bodies: dict[int, tuple[int, int]]
    incremental: bool


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def layout(renderer: ChatRenderer, messages: list[Message], add_generation_prompt: bool = False) -> Layout:
    """Find each message and assistant body in the rendering of `messages` (see the module docstring)."""
    full = renderer.text(messages, add_generation_prompt)
    prefixes = [renderer.text(messages[: j + 1]) for j in range(len(messages))]  # through message j
    starts = [0]
    for prefix in prefixes:
        starts.append(max(starts[-1], _common_prefix(prefix, full)))
    bodies: dict[int, tuple[int, int]] = {}
    first_header = None
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        if i == 0:
            raise TemplateError("message 0 is an assistant turn: a conversation starts with a system or user message")
        prompted = renderer.text(messages[:i], add_generation_prompt=True)
        header = prompted[_common_prefix(prompted, prefixes[i - 1]) :]  # the generation prompt
        first_header = header if first_header is None else first_header
        if not full.startswith(prompted):  # earlier turns render differently now
            return _layout_by_search(renderer, messages, full, first_header)
        body_end = _end_of_turn(renderer, full, len(prompted), i)
        if body_end > starts[i + 1]:  # the rendering through this message does not hold the same body
            return _layout_by_search(renderer, messages, full, first_header)
        bodies[i] = (len(prompted), body_end)
        starts[i] = min(starts[i], len(prompted) - len(header))
    return Layout(full, starts, bodies, incremental=True)


def _end_of_turn(renderer: ChatRenderer, text: str, start: int, message: int) -> int:
    """The end of the first end-of-turn token at or after `start`."""
    found = [(p, len(m)) for m in renderer.end_of_turn if (p := text.find(m, start)) >= 0]
    if not found:
        raise TemplateError(
            f"message {message}: the template ends the assistant turn with none of {list(renderer.end_of_turn)} "
            f"(name the end-of-turn token the model stops on: end_of_turn=...)"
        )
    position, length = min(found)
    return position + length


def _layout_by_search(renderer: ChatRenderer, messages: list[Message], full: str, header: str) -> Layout:
    """Not incremental: locate the assistant bodies in the one final rendering by their generation prompt.

    An assistant message starts at its generation prompt; the text after its body, up to the next assistant
    turn, goes to the message after it (the messages between two assistant turns cannot be told apart)."""
    if not header:
        raise TemplateError(
            "the chat template renders earlier turns differently once later ones exist, and its generation "
            "prompt is empty, so the assistant turns cannot be located in its rendering"
        )
    n = len(messages)
    header_at: dict[int, int] = {}
    bodies: dict[int, tuple[int, int]] = {}
    cursor = 0
    for i, message in enumerate(messages):
        if message.role == "assistant":
            position = full.find(header, cursor)
            if position < 0:
                raise TemplateError(f"message {i}: assistant turn not found in the rendering (no {header!r} left)")
            header_at[i] = position
            bodies[i] = (position + len(header), _end_of_turn(renderer, full, position + len(header), i))
            cursor = bodies[i][1]
    starts = [0] * (n + 1)
    starts[n] = len(full)
    for i in reversed(range(1, n)):
        if i in header_at:
            starts[i] = header_at[i]
        elif i - 1 in bodies:
            starts[i] = bodies[i - 1][1]
        else:
            starts[i] = starts[i + 1]
    return Layout(full, starts, bodies, incremental=False)


# ---------------------------------------------------------------- the row
@dataclass
class ConversationRow:
    """A conversation as a rollout row (module docstring). `behavior_logprobs` is None when the row was rendered
    from text: nobody sampled it, so they must be computed (opd_cache/rollout/ingest.py)."""

    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8, one per response token
    turn_index: np.ndarray  # int16, one per response token
    behavior_logprobs: np.ndarray | None  # float32, one per response token, 0.0 where the mask is 0
    messages: list[Message]
    finish_reason: str = "stop"  # "length" when the last assistant turn was cut by the token budget
    end_reason: str = "answered"  # why the conversation ended (environment.py: answered, max_turns, ...)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class _Pieces:
    """Token pieces in order: ids, mask value, turn index and (for sampled bodies) behavior log-probs."""

    ids: list[np.ndarray] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    logprobs: list[np.ndarray | None] = field(default_factory=list)

    def add(self, ids, mask: int, turn: int, logprobs=None) -> None:
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids):
            self.ids.append(ids)
            self.mask.append(mask)
            self.turn.append(turn)
            self.logprobs.append(None if logprobs is None else np.asarray(logprobs, dtype=np.float32))

    def row(self, prompt_ids, messages: list[Message], **fields) -> ConversationRow:
        last = max((k for k, m in enumerate(self.mask) if m), default=None)
        if last is None:
            raise MessageError("the conversation has no trained assistant token")
        keep = range(last + 1)  # trailing untrained pieces: nothing to train after them
        lengths = [len(self.ids[k]) for k in keep]
        response = np.concatenate([self.ids[k] for k in keep])
        mask = np.repeat(np.array([self.mask[k] for k in keep], dtype=np.uint8), lengths)
        turn = np.repeat(np.array([self.turn[k] for k in keep], dtype=np.int16), lengths)
        logprobs = None
        if any(self.logprobs[k] is not None for k in keep):
            logprobs = np.concatenate(
                [
                    self.logprobs[k] if self.logprobs[k] is not None and self.mask[k] else np.zeros(n, np.float32)
                    for k, n in zip(keep, lengths)
                ]
            )
        return ConversationRow(
            np.asarray(prompt_ids, dtype=np.int32), response, mask, turn, logprobs, messages, **fields
        )


def _message_pieces(pieces: _Pieces, renderer: ChatRenderer, lay: Layout, messages, first: int, stop: int) -> None:
    """Append messages `first..stop-1` of `lay` as pieces (bodies encoded from their text)."""
    text = lay.text
    for i in range(first, stop):
        start, end = lay.starts[i], lay.starts[i + 1]
        if i in lay.bodies:
            a, b = lay.bodies[i]
            if start < a:
                pieces.add(renderer.encode(text[start:a]), 0, i)
            pieces.add(renderer.encode(text[a:b]), int(messages[i].trained), i)
            pieces.add(renderer.encode(text[b:end]), 0, i)
        else:
            pieces.add(renderer.encode(text[start:end]), 0, i)


def render_conversation(
    renderer: ChatRenderer, messages: list[Message], where: str = "conversation"
) -> ConversationRow:
    """A whole conversation given as messages, as a row (module docstring); `where` names it in errors."""
    check_conversation(messages, where)
    try:
        lay = layout(renderer, messages)
    except TemplateError as e:
        raise TemplateError(f"{where}: {e}") from None
    first = next(i for i, m in enumerate(messages) if m.role == "assistant" and m.trained)
    a, b = lay.bodies[first]
    pieces = _Pieces()
    pieces.add(renderer.encode(lay.text[a:b]), 1, first)
    pieces.add(renderer.encode(lay.text[b : lay.starts[first + 1]]), 0, first)
    _message_pieces(pieces, renderer, lay, messages, first + 1, len(messages))
    return pieces.row(renderer.encode(lay.text[:a]), list(messages))


# ---------------------------------------------------------------- a conversation as it happens
class ConversationBuilder:
    """Token-in, token-out: the student's context grows by its own sampled ids and the environment's messages.

    builder = ConversationBuilder(renderer, env.reset(prompt))
    response = generate(builder.context_ids)          # the student samples its turn
    message = builder.add_assistant(response.token_ids, response.logprobs, response.finish_reason)
    builder.add_messages(env.step(message))            # tool results, then the next generation prompt
    row = builder.row()
    """

    def __init__(self, renderer: ChatRenderer, messages: list[Message]):
        if not messages or any(m.role == "assistant" for m in messages):
            raise MessageError("a conversation starts with system/user messages only (the student writes the turns)")
        self.renderer = renderer
        self.messages = list(messages)
        self.prompt_ids = np.asarray(
            renderer.encode(renderer.text(self.messages, add_generation_prompt=True)), np.int32
        )
        if not len(self.prompt_ids):
            raise MessageError("the conversation's prompt renders to no tokens")
        self.pieces = _Pieces()
        self.finish_reason = "stop"
        self.awaiting_assistant = True

    @property
    def context_ids(self) -> np.ndarray:
        """What the student conditions on for its next turn: the prompt and every piece so far."""
        return np.concatenate([self.prompt_ids, *self.pieces.ids])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(p) for p in self.pieces.ids)

    def add_assistant(self, token_ids, logprobs, finish_reason: str = "stop") -> Message:
        """Append the student's sampled turn (mask 1) and return the message it stands for."""
        if not self.awaiting_assistant:
            raise MessageError("add_assistant: the last turn was the assistant's; add the environment's messages")
        token_ids = np.asarray(token_ids, dtype=np.int32)
        if len(logprobs) != len(token_ids):
            raise MessageError(f"add_assistant: {len(logprobs)} log-probs for {len(token_ids)} tokens")
        self.pieces.add(token_ids, 1, len(self.messages), logprobs)
        text = self.renderer.decode(token_ids)
        ended = next((m for m in self.renderer.end_of_turn if text.endswith(m)), None)
        if ended is not None:
            text = text[: -len(ended)]
        elif finish_reason == "stop":
            finish_reason = "length"  # stopped without the end-of-turn token: the turn cannot be continued
        message = self.renderer.parse_assistant(text)
        self.messages.append(message)
        self.finish_reason = finish_reason
        self.awaiting_assistant = False
        return message

    def add_messages(self, messages: list[Message]) -> None:
        """Append the environment's messages (mask 0) and the next generation prompt."""
        if self.awaiting_assistant or self.finish_reason != "stop":
            raise MessageError("add_messages: only after an assistant turn that ended with its end-of-turn token")
        if not messages or any(m.role == "assistant" for m in messages):
            raise MessageError("add_messages: the environment answers with tool (or user) messages")
        last = len(self.messages) - 1
        self.messages.extend(messages)
        lay = layout(self.renderer, self.messages, add_generation_prompt=True)
        _, body_end = lay.bodies[last]
        self.pieces.add(self.renderer.encode(lay.text[body_end : lay.starts[last + 1]]), 0, last)
        _message_pieces(self.pieces, self.renderer, lay, self.messages, last + 1, len(self.messages))
        self.pieces.add(self.renderer.encode(lay.text[lay.starts[-1] :]), 0, len(self.messages))
        self.awaiting_assistant = True

    def row(self, end_reason: str = "answered") -> ConversationRow:
        return self.pieces.row(
            self.prompt_ids, list(self.messages), finish_reason=self.finish_reason, end_reason=end_reason
        )
