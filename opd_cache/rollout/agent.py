"""Multi-turn rollouts in `opd rollout`: the student converses with an environment, each conversation one row.

With `rollout.agent.environment` set, the rollout worker samples each prompt's `n` conversations here instead of
`n` single responses (docs/agents.md):

    prompt -> env.reset(prompt) -> student turn -> env.step -> tool results -> student turn -> ... -> Done
           -> a ConversationRow (ids, loss mask, turn index, behavior log-probs) -> a RolloutRow in the shard

Everything else about the worker (pacing, reloads, resume, shard ids and metadata) is unchanged: a shard of
conversations is a rollout shard whose rows carry a loss mask (docs/design.md §3, "Schema version 2"), published
by the worker's flush. A conversation whose every response token is trained (one assistant turn, no tool call)
is stored as a single-turn row.

`sampling.max_new_tokens` bounds each assistant turn; `agent.max_tokens` the whole conversation (prompt
included); `agent.max_turns` the assistant turns. Why each conversation ended (the environment's `Done.reason`,
or a limit) and its tool calls go into the row's `extra` JSON under "agent", so tool-call success can be read
from the shards (`agent_summary`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from opd_cache.config import AgentConfig
from opd_cache.engine import SampleRequest
from opd_cache.rollout.conversation import ChatRenderer, ConversationRow
from opd_cache.rollout.environment import (
    CalculatorEnvironment,
    ConversationLimits,
    Environment,
    engine_generate_fn,
    run_conversations,
)
from opd_cache.rollout.writer import RolloutRow, RolloutRows, RowError
from opd_cache.tasks.prompts import PromptSet

# environment name (rollout.agent.environment) -> a factory taking rollout.agent.environment_options
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"calculator": CalculatorEnvironment}


class AgentShardBuffer(RolloutRows):
    """The rollout worker's buffer of conversation rows (RolloutRows, plus what the worker's flush reports)."""

    def length_fraction(self) -> float:
        return sum(r.finish_reason == "length" for r in self.rows) / max(len(self.rows), 1)


@dataclass
class AgentSampler:
    """Samples `n` conversations per prompt with an engine; `sample` adds them to the worker's buffer."""

    cfg: AgentConfig
    renderer: ChatRenderer
    limits: ConversationLimits
    vocab_size: int
    end_reasons: Counter = field(default_factory=Counter)  # over this worker's conversations

    @classmethod
    def from_config(cls, cfg: AgentConfig, tokenizer, max_new_tokens: int, student_topk: int = 0) -> AgentSampler:
        if cfg.environment not in ENVIRONMENTS:
            raise ValueError(
                f"rollout.agent.environment {cfg.environment!r}: expected one of {', '.join(ENVIRONMENTS)}"
            )
        if student_topk:
            raise ValueError("rollout.student_topk > 0 (union support) is not supported with rollout.agent yet")
        make = ENVIRONMENTS[cfg.environment]
        try:
            tools = make(**cfg.environment_options).tools
        except TypeError as e:
            raise ValueError(f"rollout.agent.environment_options {cfg.environment_options}: {e}") from None
        if cfg.chat_template is not None:
            if not os.path.isfile(cfg.chat_template):
                raise ValueError(f"rollout.agent.chat_template {cfg.chat_template}: no such file")
            renderer = ChatRenderer.from_file(tokenizer, cfg.chat_template, tools=tools)
        else:
            renderer = ChatRenderer(tokenizer, tools=tools)
        limits = ConversationLimits(cfg.max_turns, cfg.max_tokens, max_new_tokens)
        return cls(cfg, renderer, limits, len(tokenizer))

    def environment(self) -> Environment:
        return ENVIRONMENTS[self.cfg.environment](**self.cfg.environment_options)

    def sample(
        self, engine, prompts: PromptSet, positions: np.ndarray, n: int, request: SampleRequest, buffer: RolloutRows
    ) -> tuple[int, int]:
        """Run `n` conversations for each prompt at `positions`, add them to `buffer`; (rows, response tokens)."""
        prompt_of = [int(p) for p in positions for _ in range(n)]
        inputs = [environment_prompt(prompts, p) for p in prompt_of]
        envs = [self.environment() for _ in inputs]
        conversations = run_conversations(engine_generate_fn(engine, request), envs, inputs, self.renderer, self.limits)
        tokens = 0
        for i, (p, env, row) in enumerate(zip(prompt_of, envs, conversations)):
            self.end_reasons[row.end_reason] += 1
            buffer.add(self._rollout_row(prompts, p, i % n, env, row))
            tokens += len(row.response_ids)
        return len(conversations), tokens

    def _rollout_row(self, prompts: PromptSet, p: int, sample: int, env, row: ConversationRow) -> RolloutRow:
        extra = json.loads(prompts.extra[p]) if prompts.extra[p] else {}
        if not isinstance(extra, dict):
            extra = {"extra": extra}
        extra["agent"] = {
            "end_reason": row.end_reason,
            "turns": sum(m.role == "assistant" for m in row.messages),
            "tool_calls": getattr(env, "calls", None),
            "failed_tool_calls": getattr(env, "failed_calls", None),
        }
        try:
            return RolloutRow.checked(
                self.vocab_size,
                prompt_ids=row.prompt_ids,
                response_ids=row.response_ids,
                behavior_logprobs=row.behavior_logprobs,
                loss_mask=row.loss_mask,
                turn_index=row.turn_index,
                finish_reason=row.finish_reason,
                prompt_index=prompts.row_index[p],
                sample_index=sample,
                data_source=prompts.data_source[p],
                ground_truth=prompts.ground_truth[p],
                extra=json.dumps(extra),
            )
        except RowError as e:  # the loop made it: a bug, not bad input
            raise RuntimeError(f"conversation of prompt row {prompts.row_index[p]}: {e}") from None


def environment_prompt(prompts: PromptSet, p: int) -> dict:
    """What `env.reset` gets: the prompt's last user message as `question`, its ground truth, all its messages."""
    messages = prompts.messages[p] if prompts.messages else []
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return {"question": users[-1] if users else "", "ground_truth": prompts.ground_truth[p], "messages": messages}


def agent_summary(extras: list[str | None]) -> dict:
    """Counts over rollout rows' `extra` JSON: conversations, why they ended, tool calls and failed calls."""
    reasons: Counter = Counter()
    calls = failed = 0
    for text in extras:
        agent = json.loads(text).get("agent") if text else None
        if not agent:
            continue
        reasons[agent["end_reason"]] += 1
        calls += agent.get("tool_calls") or 0
        failed += agent.get("failed_tool_calls") or 0
    return {"conversations": sum(reasons.values()), "end_reasons": dict(reasons), "tool_calls": calls, "failed": failed}
