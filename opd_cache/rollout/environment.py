"""Environments the student acts in, and the agent loop that runs conversations with them.

The interface (docs/agents.md) is two methods:

    env.reset(prompt) -> list[Message]                  the opening messages (system, user) for one prompt
    env.step(assistant_message) -> list[Message] | Done  the tool results to continue with, or the end

plus `env.tools`: the OpenAI-style tool definitions, rendered by chat templates that show them. An environment
object serves one conversation at a time (`reset` starts a new one); `run_conversations` takes one per
conversation. The loop, not the environment, enforces the limits: at most `max_turns` assistant turns and
`max_tokens` tokens per conversation (prompt included), each turn at most `max_new_tokens`.

`CalculatorEnvironment` is the demo family's environment: the arithmetic question ("What is 37 + 48?") and one
tool, `calc`, that evaluates an arithmetic expression (`[calc(37+48)]` in the demo template's syntax -> `85`).
The student is meant to call it, then answer (" #### 85"); the environment counts calls and failures and says
whether the answer came after a successful call (`Done.reason`).

`run_conversations(generate, envs, prompts, renderer, limits)` runs conversations in lock-step: every round,
one `generate` call samples the next turn of each conversation still going, so a batched engine (the rollout
worker's) stays batched. `generate(context_ids, max_new_tokens) -> list[Response]` (one per context, the
engine-neutral `Response` of opd_cache/engine.py); `engine_generate_fn` adapts a `Generator`.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from opd_cache.engine import Response, SampleRequest
from opd_cache.rollout.conversation import ChatRenderer, ConversationBuilder, ConversationRow
from opd_cache.rollout.messages import Message


@dataclass(frozen=True)
class Done:
    """The environment ends the conversation: `reason` says why (e.g. "answered"), `reward` if it scores it."""

    reason: str = "answered"
    reward: float | None = None


class Environment(Protocol):
    tools: list[dict]

    def reset(self, prompt) -> list[Message]: ...

    def step(self, assistant: Message) -> list[Message] | Done: ...


@dataclass(frozen=True)
class ConversationLimits:
    max_turns: int = 4  # assistant turns per conversation
    max_tokens: int = 512  # tokens per conversation, prompt included
    max_new_tokens: int = 64  # tokens per assistant turn

    def __post_init__(self):
        for name in ("max_turns", "max_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"conversation limit {name} must be >= 1, got {getattr(self, name)}")


# ---------------------------------------------------------------- the calculator
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_EXPRESSION = 64  # characters
_MAX_MAGNITUDE = 10**12


REQUIRE_TOOL_REPLY = "Check it with calc."  # the user's reply to an unchecked answer (require_tool)


class CalculatorError(ValueError):
    pass


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text ("85", "2.5"); CalculatorError says what is wrong.

    Parsed with `ast` and evaluated node by node: integers, + - * / // %, unary minus, parentheses; nothing
    else (no names, calls or powers), at most 64 characters, intermediate values within 10^12."""
    if len(expression) > _MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            result = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            result = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                raise CalculatorError("division by zero")
            result = _OPERATORS[type(node.op)](left, right)
        else:
            raise CalculatorError(f"only numbers and + - * / // % ( ) are allowed in {expression!r}")
        if abs(result) > _MAX_MAGNITUDE:
            raise CalculatorError(f"a value exceeds {_MAX_MAGNITUDE:.0e}")
        return result

    result = value(tree)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result) if isinstance(result, int) else f"{result:.6g}"


@dataclass
class CalculatorEnvironment:
    """The arithmetic task with a calculator tool (module docstring).

    `reset(prompt)`: the prompt is the question text, or a dict with `question` (or `prompt`) and optionally
    `ground_truth`. `step(message)`: tool results for its `calc` calls (an unknown tool or a bad expression is
    answered with an `error: ...` result the student can read), or `Done` when the message calls no tool:
    reason "answered" after at least one successful call, "answered_without_tool" otherwise,
    "bad_tool_call" when the message's tool call did not parse, "too_many_calls" past `max_calls`.
    With `require_tool`, an answer before any successful call is not the end: the user replies
    `REQUIRE_TOOL_REPLY` and the student takes another turn (until the loop's `max_turns`).
    """

    max_calls: int = 4
    require_tool: bool = False
    tools: list[dict] = field(default_factory=lambda: [CALC_TOOL])
    calls: int = 0  # tool calls in the current conversation
    failed_calls: int = 0  # of which answered with an error
    ground_truth: str | None = None

    def reset(self, prompt) -> list[Message]:
        self.calls = self.failed_calls = 0
        if isinstance(prompt, dict):
            self.ground_truth = prompt.get("ground_truth")
            prompt = prompt.get("question", prompt.get("prompt"))
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"calculator environment: the prompt must be question text, got {prompt!r}")
        return [Message(role="user", content=prompt)]

    def step(self, assistant: Message) -> list[Message] | Done:
        if assistant.parse_error is not None:
            return Done("bad_tool_call")
        if not assistant.tool_calls:
            if self.require_tool and self.calls == self.failed_calls:
                return [Message(role="user", content=REQUIRE_TOOL_REPLY)]
            return Done("answered" if self.calls > self.failed_calls else "answered_without_tool")
        if self.calls + len(assistant.tool_calls) > self.max_calls:
            return Done("too_many_calls")
        results = []
        for call in assistant.tool_calls:
            self.calls += 1
            try:
                if call.name != "calc":
                    raise CalculatorError(f"unknown tool {call.name!r} (the tool is calc)")
                arguments = call.arguments
                expression = arguments.get("expression") if isinstance(arguments, dict) else arguments
                if not isinstance(expression, str):
                    raise CalculatorError("calc takes one expression")
                content = calculate(expression)
            except CalculatorError as e:
                self.failed_calls += 1
                content = f"error: {e}"
            results.append(Message(role="tool", content=content, tool_call_id=call.id, name=call.name))
        return results


# ---------------------------------------------------------------- the agent loop
GenerateFn = Callable[[Sequence[Sequence[int]], int], list[Response]]


def engine_generate_fn(engine, request: SampleRequest) -> GenerateFn:
    """`generate(contexts, max_new_tokens)` on a `Generator` (hf_generate / vllm_generate): one sample per
    context with `request`'s sampling, its token limit replaced by the turn's. Successive calls advance the seed
    (when `request` has one), so turns are reproducible without repeating each other's draws."""
    calls = 0

    def generate(contexts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Response]:
        nonlocal calls
        sampling = request.sampling.model_copy(update={"max_new_tokens": max_new_tokens})
        seed = None if request.seed is None else request.seed + calls
        calls += 1
        return engine.generate(contexts, replace(request, sampling=sampling, n=1, seed=seed))

    return generate


def run_conversations(
    generate: GenerateFn,
    envs: Sequence[Environment],
    prompts: Sequence,
    renderer: ChatRenderer,
    limits: ConversationLimits = ConversationLimits(),
) -> list[ConversationRow]:
    """One conversation per (environment, prompt), all advanced together; returns their rows in order.

    A conversation ends when its environment says Done (end_reason = Done.reason), after `max_turns` assistant
    turns ("max_turns"), when its next turn would have no token left under `max_tokens` ("max_tokens"), or when
    the student's turn ends without its end-of-turn token ("length": the turn limit or the budget cut it)."""
    if len(envs) != len(prompts):
        raise ValueError(f"run_conversations: {len(envs)} environments for {len(prompts)} prompts")
    builders = [ConversationBuilder(renderer, env.reset(prompt)) for env, prompt in zip(envs, prompts)]
    end_reasons: list[str | None] = [None] * len(builders)
    for turn in range(limits.max_turns):
        active = [i for i, reason in enumerate(end_reasons) if reason is None]
        for i in active:
            if builders[i].num_tokens >= limits.max_tokens:
                end_reasons[i] = "max_tokens"
        active = [i for i in active if end_reasons[i] is None]
        if not active:
            break
        rooms = [min(limits.max_new_tokens, limits.max_tokens - builders[i].num_tokens) for i in active]
        responses = generate([builders[i].context_ids for i in active], max(rooms))
        if len(responses) != len(active):
            raise ValueError(f"generate returned {len(responses)} responses for {len(active)} contexts")
        for i, room, response in zip(active, rooms, responses):
            ids, logprobs, finish = response.token_ids, response.logprobs, response.finish_reason
            if len(ids) > room:  # a shorter limit would have cut the same draw here
                ids, logprobs, finish = ids[:room], logprobs[:room], "length"
            message = builders[i].add_assistant(ids, logprobs, finish)
            if builders[i].finish_reason != "stop":
                end_reasons[i] = "length"
                continue
            outcome = envs[i].step(message)
            if isinstance(outcome, Done):
                end_reasons[i] = outcome.reason
            elif turn + 1 < limits.max_turns:
                builders[i].add_messages(outcome)
            else:
                end_reasons[i] = "max_turns"
    return [b.row(end_reason=reason or "max_turns") for b, reason in zip(builders, end_reasons)]


def run_conversation(
    generate: GenerateFn,
    env: Environment,
    prompt,
    renderer: ChatRenderer,
    limits: ConversationLimits = ConversationLimits(),
) -> ConversationRow:
    """One conversation (`run_conversations` with one environment)."""
    return run_conversations(generate, [env], [prompt], renderer, limits)[0]
