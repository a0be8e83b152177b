"""Environments and the agent loop (rollout/environment.py): the calculator, the limits, a scripted student and a
real tiny model sampled by the rollout engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd_cache.config import SamplingConfig
from opd_cache.engine import Response, SampleRequest
from opd_cache.rollout.conversation import ChatRenderer
from opd_cache.rollout.environment import (
    CalculatorEnvironment,
    CalculatorError,
    ConversationLimits,
    Done,
    calculate,
    engine_generate_fn,
    run_conversation,
    run_conversations,
)
from opd_cache.rollout.messages import Message, ToolCall

from .conftest import DATA
from .test_rollout import teacher_forced_logprobs


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer.from_file(tokenizer, DATA / "chat_templates" / "arithmetic_tools.jinja")


class ScriptedStudent:
    """A `generate` function that answers each question with its script, turn by turn (log-probs -0.5)."""

    def __init__(self, renderer, scripts: dict[str, list[str]]):
        self.renderer, self.scripts = renderer, {q: list(turns) for q, turns in scripts.items()}
        self.calls: list[tuple[int, int]] = []  # (contexts, max_new_tokens) per call

    def __call__(self, contexts, max_new_tokens):
        self.calls.append((len(contexts), max_new_tokens))
        out = []
        for context in contexts:
            question = self.renderer.decode(context).split("\n", 1)[0]
            ids = np.array(self.renderer.encode(self.scripts[question].pop(0)), dtype=np.int32)
            out.append(Response(ids, np.full(len(ids), -0.5, np.float32), "stop"))
        return out


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculate("37+48") == "85" and calculate("(2 + 3) * -4") == "-20" and calculate("7/2") == "3.5"
    assert calculate("9/3") == "3" and calculate("7 // 2") == "3" and calculate("7 % 4") == "3"
    for bad, message in [
        ("__import__('os')", "only numbers"),
        ("2**100", "only numbers"),
        ("1/0", "division by zero"),
        ("9" * 13, "exceeds"),
        ("1+", "cannot parse"),
        ("1+" * 40 + "1", "longer than 64"),
    ]:
        with pytest.raises(CalculatorError, match=message):
            calculate(bad)


def test_calculator_environment_answers_calls_and_ends_on_an_answer():
    env = CalculatorEnvironment()
    assert env.reset({"question": "What is 37 + 48?", "ground_truth": "85"}) == [Message("user", "What is 37 + 48?")]
    results = env.step(
        Message("assistant", "", [ToolCall("calc", "37+48", "c1"), ToolCall("calc", {"expression": "2*3"})])
    )
    assert [(m.role, m.content, m.tool_call_id) for m in results] == [("tool", "85", "c1"), ("tool", "6", None)]
    assert env.step(Message("assistant", " #### 85")) == Done("answered")
    assert (env.calls, env.failed_calls, env.ground_truth) == (2, 0, "85")

    env.reset("What is 1 + 2?")
    assert env.step(Message("assistant", "", [ToolCall("search", "x")]))[0].content.startswith("error: unknown tool")
    assert env.step(Message("assistant", " #### 3")) == Done("answered_without_tool")  # its only call failed
    assert env.step(Message("assistant", "[calc(", parse_error="not closed")) == Done("bad_tool_call")
    env.reset("What is 1 + 2?")
    assert env.step(Message("assistant", "", [ToolCall("calc", "1")] * 5)) == Done("too_many_calls")
    with pytest.raises(ValueError, match="the prompt must be question text"):
        env.reset({"question": ""})


def test_the_loop_runs_conversations_in_lock_step_with_masks_at_the_student_turns(renderer):
    student = ScriptedStudent(
        renderer,
        {
            "What is 37 + 48?": ["[calc(37+48)]<eos>", " #### 85<eos>"],
            "What is 10 + 20?": [" #### 30<eos>"],
            "What is 11 + 11?": ["[calc(11+11)]<eos>", "[calc(22/0)]<eos>", "[calc(11*2)]<eos>", " #### 22<eos>"],
        },
    )
    questions = ["What is 37 + 48?", "What is 10 + 20?", "What is 11 + 11?"]
    envs = [CalculatorEnvironment() for _ in questions]
    rows = run_conversations(student, envs, questions, renderer, ConversationLimits(max_turns=3, max_new_tokens=32))
    assert [count for count, _ in student.calls] == [3, 2, 1]  # one generate call per round
    assert [r.end_reason for r in rows] == ["answered", "answered_without_tool", "max_turns"]

    first = rows[0]
    assert renderer.decode(first.prompt_ids) == "What is 37 + 48?\n"
    assert renderer.decode(first.response_ids) == "[calc(37+48)]<eos>= 85\n #### 85<eos>"
    trained = "".join(renderer.decode([t]) for t, m in zip(first.response_ids, first.loss_mask) if m)
    assert trained == "[calc(37+48)]<eos> #### 85<eos>"
    assert first.turn_index.tolist() == [1] * 14 + [2] * 5 + [3] * 9
    assert np.all(first.behavior_logprobs[first.loss_mask == 1] == -0.5)
    assert not first.behavior_logprobs[first.loss_mask == 0].any()
    # the turn limit ends the third conversation before its tool results are rendered: nothing untrained trails
    third = rows[2]
    assert renderer.decode(third.response_ids).endswith("[calc(11*2)]<eos>") and third.loss_mask[-1] == 1
    assert "= error: division by zero\n" in renderer.decode(third.response_ids)
    assert (envs[2].calls, envs[2].failed_calls) == (3, 1)


def test_the_token_budget_cuts_the_turn_that_reaches_it(renderer):
    student = ScriptedStudent(renderer, {"What is 37 + 48?": ["[calc(37+48)]<eos>", " #### 85<eos>"]})
    limits = ConversationLimits(max_turns=4, max_tokens=17 + 14 + 5 + 4, max_new_tokens=64)
    row = run_conversation(student, CalculatorEnvironment(), "What is 37 + 48?", renderer, limits)
    assert student.calls == [(1, 40 - 17), (1, 4)]  # the budget less the context; the second turn gets 4 tokens
    assert row.num_tokens == limits.max_tokens and (row.end_reason, row.finish_reason) == ("length", "length")
    assert renderer.decode(row.response_ids).endswith("= 85\n ###")


def test_a_real_model_sampled_by_the_rollout_engine_over_several_turns(tiny_model_factory, tokenizer, renderer):
    """The engine's sampled ids go into the row as they are, across turns: the behavior log-probs at the trained
    positions equal the model's own teacher-forced log-probs over the whole conversation (temperature 1)."""
    from opd_cache.rollout.hf_generate import HFGenerator

    path = tiny_model_factory("student", seed=3)
    engine = HFGenerator(path, tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id], vocab_limit=len(tokenizer))
    with torch.no_grad():  # lean towards EOS, so that turns end on their own within a few tokens
        hidden = engine.model.base_model(torch.tensor([renderer.encode("What is 1 + 2?\n")])).last_hidden_state
        direction = hidden[0].mean(0)
        engine.model.get_output_embeddings().weight[tokenizer.eos_token_id] = direction / direction.norm() ** 2 * 4.0

    class EchoEnvironment:
        """Answers every turn with a tool result, twice, then ends: the conversation always has three turns."""

        tools: list = []

        def reset(self, prompt):
            self.turns = 0
            return [Message("user", prompt)]

        def step(self, assistant):
            self.turns += 1
            return Done() if self.turns == 3 else [Message("tool", f"r{self.turns}")]

    generate = engine_generate_fn(engine, SampleRequest(SamplingConfig(max_new_tokens=48), seed=7))
    questions = ["What is 1 + 2?", "What is 30 + 4?"]
    rows = run_conversations(
        generate, [EchoEnvironment() for _ in questions], questions, renderer, ConversationLimits(max_turns=3)
    )
    scorer = engine.model
    for row in rows:
        text = renderer.decode(row.response_ids)
        if row.end_reason == "answered":
            assert text.count("= r") == 2 and text.endswith("<eos>")
        expected = teacher_forced_logprobs(scorer, row.prompt_ids.tolist(), row.response_ids.tolist())
        trained = row.loss_mask == 1
        np.testing.assert_allclose(row.behavior_logprobs[trained], expected[trained], atol=1e-4)
        assert not row.behavior_logprobs[~trained].any()
    assert any(r.end_reason == "answered" for r in rows), [renderer.decode(r.response_ids) for r in rows]
