"""The agent evaluator (opd_cache/evaluate_agent.py): KL at trained positions only, greedy conversations scored
for tool-call success and final-answer accuracy, and issue #28's bar."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from opd_cache.config import AgentConfig
from opd_cache.engine import Response
from opd_cache.evaluate import first_prompts, masked_sequence_kl, sequence_kl
from opd_cache.evaluate_agent import AgentEvalResult, agent_bar, evaluate_agent_model, evaluation_sampler
from opd_cache.models import load_causal_lm
from opd_cache.tasks.prompts import load_prompts
from tests.conftest import REPO

AGENT_TEACHER, AGENT_STUDENT = REPO / "data/models/agent_teacher", REPO / "data/models/agent_student"
TOOLS_TEMPLATE = REPO / "data/chat_templates/arithmetic_tools.jinja"


def test_masked_kl_sums_the_trained_positions_only(tiny_model_factory):
    student = load_causal_lm(tiny_model_factory("student", seed=0)).eval()
    teacher = load_causal_lm(tiny_model_factory("teacher", seed=1)).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40, size=n).tolist() for n in (5, 7)]
    responses = [rng.integers(3, 40, size=n).tolist() for n in (6, 4)]
    masks = [np.array([1, 1, 0, 0, 1, 1], np.uint8), None]  # a conversation's mask; a single-turn row's none

    total, count = masked_sequence_kl(student, teacher, prompts, responses, masks, "cpu")
    expected = 0.0
    for prompt, response, mask in zip(prompts, responses, masks):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            log_q = F.log_softmax(student(input_ids=ids).logits[0].float(), -1)
            log_p = F.log_softmax(teacher(input_ids=ids).logits[0].float(), -1)
        for t in range(len(response)):
            if mask is None or mask[t]:
                at = len(prompt) + t - 1  # the position that predicts response token t
                expected += float((log_p[at].exp() * (log_p[at] - log_q[at])).sum())
    assert count == 4 + 4
    assert abs(total - expected) < 1e-4 * max(1.0, abs(expected))
    # without masks: every response token, as sequence_kl (single-turn evaluation) counts them
    as_responses = [Response(np.asarray(r, np.int32), np.zeros(len(r), np.float32), "stop") for r in responses]
    assert masked_sequence_kl(student, teacher, prompts, responses, None, "cpu") == sequence_kl(
        student, teacher, prompts, as_responses, "cpu"
    )


def test_the_agent_teacher_calls_the_tool_and_the_agent_student_does_not(tokenizer):
    prompts = first_prompts(load_prompts(REPO / "data/arithmetic/test.parquet", tokenizer), 16)
    agent = AgentConfig(
        environment="calculator",
        environment_options={"require_tool": True},  # the evaluator turns it off: no second chance
        chat_template=str(TOOLS_TEMPLATE),
        max_turns=3,
        max_tokens=96,
    )
    sampler = evaluation_sampler(agent, tokenizer, 16)
    teacher = evaluate_agent_model(AGENT_TEACHER, prompts, tokenizer, sampler, device="cpu")
    assert teacher.tool_success == 1.0 and teacher.strict >= 0.9, teacher
    assert teacher.turns == 2.0 and teacher.end_reasons == {"answered": 16}, teacher
    assert teacher.example.startswith("[calc(")

    student = evaluate_agent_model(
        AGENT_STUDENT, prompts, tokenizer, sampler, teacher=load_causal_lm(AGENT_TEACHER).eval(), device="cpu"
    )
    # greedy, the student answers " ans= N" at once: right by the lenient parser, never the tool
    assert student.tool_success == 0.0 and student.strict == 0.0 and student.lenient >= 0.9, student
    assert student.end_reasons == {"answered_without_tool": 16} and student.turns == 1.0
    assert student.kl is not None and student.kl > 1.0  # the teacher would have called the tool


def result(tool_success: float, strict: float, kl: float | None) -> AgentEvalResult:
    return AgentEvalResult(tool_success, strict, strict, kl, 10, 2.0, 20.0, {}, "")


def test_the_bar_checks_each_measure():
    teacher = result(1.0, 0.9, None)
    assert agent_bar(teacher, result(0.0, 0.0, 2.0), result(0.8, 0.75, 0.4))["passed"]
    below = agent_bar(teacher, result(0.0, 0.0, 2.0), result(0.79, 0.9, 0.1))
    assert below["checks"] == {"tool_success": False, "strict": True, "kl_factor": True} and not below["passed"]
    assert not agent_bar(teacher, result(0.0, 0.0, 2.0), result(1.0, 0.7, 0.1))["passed"]
    slow_kl = agent_bar(teacher, result(0.0, 0.0, 2.0), result(1.0, 0.9, 0.5))
    assert slow_kl["kl_factor"] == 4.0 and not slow_kl["passed"]


def test_opd_eval_agent_scores_a_checkpoint_and_checks_the_bar():
    """`opd eval-agent CHECKPOINT --config …`: the untrained student given as the checkpoint is the 'after' model, so
    after equals before (same greedy conversations, same KL) and the bar is not met: --check exits 1."""
    import json

    from typer.testing import CliRunner

    from opd_cache.cli import app

    args = ["eval-agent", "data/models/agent_student", "--config", "examples/arithmetic_agent_cpu/config.yaml"]
    args += ["--max-prompts", "4", "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["version"] is None and report["teacher"]["tool_success"] == 1.0
    assert report["after"] == report["before"] and report["before"]["kl"] > 0
    assert report["bar"]["kl_factor"] == 1.0 and not report["bar"]["passed"]
    checked = CliRunner().invoke(app, [*args, "--check"])
    assert checked.exit_code == 1 and "NOT MET" in checked.stdout and "the checkpoint" in checked.stdout
    missing = CliRunner().invoke(app, [*args[:2], "--config", "examples/nope.yaml"])
    assert missing.exit_code != 0 and "examples/nope.yaml does not exist" in missing.output
