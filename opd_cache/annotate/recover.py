"""The messages behind a multi-turn rollout row, read back from the student's rendering of them.

A multi-turn row (docs/agents.md) is token ids, a loss mask and a turn index: the student's chat template
rendered around the conversation, with the assistant turns the student sampled. A teacher with another chat
template or tokenizer needs the conversation itself (annotate/rerender.py re-renders it). The row says a lot
about it: the number of messages (the last turn index + 1), which are trained assistant turns and where their
bodies lie (the mask), and where every message after the prompt starts and ends (the turn index). The rest is
parsed message by message, left to right, against the student's own template:

- a trained assistant turn: the text before its body must be the rendering of the messages so far with the
  generation prompt; the body (its end-of-turn token removed) is parsed as the model's output, exactly as rollout
  made the message from the sampled ids (`ChatRenderer.parse_assistant`: content and tool calls);
- any other message: each role is tried. A user, system or tool message is the template rendered around a
  placeholder content, matched against the text; an untrained assistant turn runs from the generation prompt to
  the first end-of-turn token. Every candidate must re-render to the text so far, and stop agreeing with it
  exactly where its turn ends when the turn index gives that end (the rule `layout` cut the turns by, which also
  places messages a template closes jointly: Qwen2.5's consecutive tool results). The most specific candidate
  goes first, the one with the most template text around the shortest content (`= 85\n` is a tool result `85`
  in the demo template before it is a user message `= 85`), then user, tool, system, assistant; a tool message
  only follows a tool call or a tool message. A candidate that leads nowhere later is taken back (a bounded
  depth-first search).

Tested on the demo template, a second demo-like one, and the Qwen2.5- and Llama-3.1-style templates of
tests/test_conversation.py. A template that renders earlier turns differently once later ones exist (Qwen3 drops
old reasoning) is not read back: `RecoveryError`, and annotate excludes the row. What a template does not render
cannot be read back (tool-call ids); two roles it renders identically (user and system in the demo template)
cannot be told apart: the preferred one is taken.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from opd_cache.rollout.conversation import ChatRenderer
from opd_cache.rollout.messages import Message

_PLACEHOLDER = "<<opd-content>>"
_ROLE_ORDER = ("user", "tool", "system", "assistant")  # ties between equally specific candidates
MAX_PARSE_STEPS = 256  # candidates tried per row before it is given up on
MAX_CONTENT_ENDS = 64  # places a message's content may end, per role tried


class RecoveryError(ValueError):
    """A row whose messages cannot be read back from its rendering (the text says why)."""


@dataclass
class RenderedRow:
    """A row's text and, per turn, where its tokens lie in it (character offsets)."""

    text: str  # the prompt and the response, decoded piece by piece
    prompt_end: int  # where the response (the first trained body) starts
    num_messages: int  # the last turn index + 1: the row ends in that message's trained body
    turns: dict[int, tuple[int, int]]  # turn -> span of its response tokens
    bodies: dict[int, tuple[int, int]]  # trained turn -> span of its mask-1 tokens
    body_ids: dict[int, np.ndarray]  # trained turn -> its mask-1 ids (the ids the student sampled)

    @classmethod
    def of(cls, renderer: ChatRenderer, prompt_ids, response_ids, loss_mask, turn_index) -> RenderedRow:
        response_ids, loss_mask, turn_index = (np.asarray(a) for a in (response_ids, loss_mask, turn_index))
        if not len(response_ids) or not (len(response_ids) == len(loss_mask) == len(turn_index)):
            raise RecoveryError("the row's response, loss mask and turn index differ in length (or are empty)")
        text = renderer.decode(prompt_ids)
        prompt_end = len(text)
        turns: dict[int, tuple[int, int]] = {}
        bodies: dict[int, tuple[int, int]] = {}
        body_ids: dict[int, np.ndarray] = {}
        # runs of one (turn, mask): each was encoded from its own stretch of text, so it decodes on its own
        cuts = np.nonzero((np.diff(turn_index) != 0) | (np.diff(loss_mask) != 0))[0] + 1
        for start, stop in zip(np.r_[0, cuts], np.r_[cuts, len(response_ids)]):
            turn, trained = int(turn_index[start]), bool(loss_mask[start])
            piece = renderer.decode(response_ids[start:stop])
            span = (len(text), len(text) + len(piece))
            text += piece
            turns[turn] = (turns.get(turn, span)[0], span[1])
            if trained:
                if turn in bodies:
                    raise RecoveryError(f"turn {turn} has two trained stretches: one assistant body per turn")
                bodies[turn], body_ids[turn] = span, np.asarray(response_ids[start:stop])
        return cls(text, prompt_end, int(turn_index[-1]) + 1, turns, bodies, body_ids)


def recover_messages(renderer: ChatRenderer, row: RenderedRow) -> list[Message]:
    """The messages whose rendering by `renderer` is the row (module docstring); raises RecoveryError."""
    budget = [MAX_PARSE_STEPS]
    messages = _parse(renderer, row, [], budget)
    if messages is None:
        why = "no parse within the step budget" if budget[0] <= 0 else "no parse re-renders to the row's text"
        raise RecoveryError(f"the row does not read as a conversation in the student's chat template ({why})")
    return messages


def _render(renderer: ChatRenderer, messages: list[Message], add_generation_prompt: bool = False) -> str | None:
    try:
        return renderer.text(messages, add_generation_prompt)
    except Exception:  # a template that refuses this message order (raise_exception in jinja)
        return None


def _parse(renderer: ChatRenderer, row: RenderedRow, messages: list[Message], budget: list[int]) -> list | None:
    """Depth-first: the rest of the messages after `messages` (whose rendering agrees with the row's text)."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    j = len(messages)
    if j in row.bodies:
        message = _trained_turn(renderer, row, messages)
        candidates = [] if message is None else [message]
    else:
        candidates = _untrained_candidates(renderer, row, messages)
    for message in candidates:
        so_far = messages + [message]
        if j == row.num_messages - 1:
            if j in row.bodies:  # the row ends in this body: its rendering continues the row's text
                return so_far
            continue
        found = _parse(renderer, row, so_far, budget)
        if found is not None:
            return found
    return None


def _fits(renderer: ChatRenderer, row: RenderedRow, messages: list[Message], confirmed: int) -> bool:
    """The rendering of `messages` agrees with the row's text through `confirmed` (the end of the last message's
    content), and stops agreeing exactly where the last one's turn ends, when the turn index gives that end (the
    rule conversation.py's `layout` cut the turns by: a template may render a message differently once another
    follows, as Qwen2.5 closes consecutive tool results once)."""
    rendered = _render(renderer, messages)
    if rendered is None:
        return False
    j = len(messages) - 1
    if j == row.num_messages - 1:
        return rendered.startswith(row.text)  # the last turn: the row stops at its body (the tail is dropped)
    reach = len(os.path.commonprefix([rendered, row.text]))
    return reach == row.turns[j][1] if j in row.turns else reach >= confirmed


def _trained_turn(renderer: ChatRenderer, row: RenderedRow, messages: list[Message]) -> Message | None:
    """The trained assistant turn at `row.bodies[len(messages)]`, or None if the text before it does not fit."""
    j = len(messages)
    a, b = row.bodies[j]
    if _render(renderer, messages, add_generation_prompt=True) != row.text[:a]:
        return None
    body = row.text[a:b]
    end = next((e for e in renderer.end_of_turn if body.endswith(e)), None)
    if end is None and j != row.num_messages - 1:
        return None  # only the last turn may be cut by the token budget
    message = renderer.parse_assistant(body[: -len(end)] if end else body)
    return message if _fits(renderer, row, messages + [message], b) else None


def _untrained_candidates(renderer: ChatRenderer, row: RenderedRow, messages: list[Message]) -> list[Message]:
    """Every reading of the next message (not a trained turn) that re-renders to the text, most specific first."""
    j = len(messages)
    # the message's text ends at its turn's end when the turn index gives it, else before the next known turn
    limit = (
        row.turns[j][1]
        if j in row.turns
        else min((s for t, (s, _) in row.turns.items() if t > j), default=len(row.text))
    )
    follows_call = bool(messages) and (messages[-1].role == "tool" or bool(messages[-1].tool_calls))
    found: list[tuple[int, int, Message]] = []
    for rank, role in enumerate(_ROLE_ORDER):
        if role == "tool" and not follows_call:
            continue
        if role == "assistant":
            options = _untrained_assistant(renderer, row, messages, limit)
        else:
            options = _placeholder_matches(renderer, row, messages, role, limit)
        found += [(len(m.content), rank, m) for m, end in options if _fits(renderer, row, messages + [m], end)]
    return [m for _, _, m in sorted(found, key=lambda f: (f[0], f[1]))]


def _placeholder_matches(
    renderer: ChatRenderer, row: RenderedRow, messages: list[Message], role: str, limit: int
) -> list[tuple[Message, int]]:
    """`role` messages (with where their content ends) whose rendering matches the text: the template around a
    placeholder. The content ends where the template's text after it starts; a later message may change that
    text (close a group of tool results once), so a start of it also counts, the whole text first."""
    probe = _render(renderer, messages + [Message(role, _PLACEHOLDER)])
    if probe is None or probe.count(_PLACEHOLDER) != 1:
        return []
    start = probe.index(_PLACEHOLDER)
    if start > limit or row.text[:start] != probe[:start]:
        return []
    after = probe[start + len(_PLACEHOLDER) :]
    if not after:  # nothing after the content: it runs to the limit
        return [(Message(role, row.text[start:limit]), limit)]
    ends: dict[int, None] = {}
    for m in range(len(after), 0, -1):
        at = row.text.find(after[:m], start)
        while 0 <= at and at + m <= limit and len(ends) < MAX_CONTENT_ENDS:
            ends.setdefault(at)
            at = row.text.find(after[:m], at + 1)
    return [(Message(role, row.text[start:end]), end) for end in ends]


def _untrained_assistant(
    renderer: ChatRenderer, row: RenderedRow, messages: list[Message], limit: int
) -> list[tuple[Message, int]]:
    """An assistant turn with weight 0: from the generation prompt through the first end-of-turn token."""
    prompted = _render(renderer, messages, add_generation_prompt=True)
    if prompted is None or not row.text.startswith(prompted):
        return []
    a = len(prompted)
    found = [(p, e) for e in renderer.end_of_turn if 0 <= (p := row.text.find(e, a)) and p + len(e) <= limit]
    if not found:
        return []
    position, end = min(found)
    message = renderer.parse_assistant(row.text[a:position])
    message.trained = False
    return [(message, position + len(end))]
