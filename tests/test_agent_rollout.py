"""Multi-turn rollouts in `opd rollout` (rollout.agent) with the demo models and the calculator, annotated at
trained positions only (the teacher's entries equal a direct forward over the whole conversation), then trained."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from opd_cache.annotate import run_annotate
from opd_cache.config import AgentConfig, load_config
from opd_cache.models import load_causal_lm
from opd_cache.rollout import run_rollout
from opd_cache.rollout.agent import AgentSampler, agent_summary
from opd_cache.rollout.environment import REQUIRE_TOOL_REPLY, CalculatorEnvironment
from opd_cache.rollout.messages import Message, ToolCall
from opd_cache.storage import layout
from opd_cache.storage.schema import ROLLOUT, flat_values, list_lengths, read_shard, trained_lengths, trained_mask
from opd_cache.storage.store import Store
from opd_cache.train import run_train

REPO = Path(__file__).resolve().parents[1]
STUDENT, TEACHER = REPO / "data/models/student", REPO / "data/models/teacher"


def agent_config(store, **rollout) -> dict:
    overrides = {
        "store.uri": store.uri,
        "rollout.student": str(STUDENT),
        "rollout.prompts": str(REPO / "data/arithmetic/train.parquet"),
        "rollout.n": 2,
        "rollout.batch_prompts": 4,
        "rollout.flush_rows": 8,
        "rollout.max_samples": 8,
        "rollout.sampling.max_new_tokens": 10,
        "rollout.agent.environment": "calculator",
        "rollout.agent.environment_options": {"require_tool": True},
        "rollout.agent.chat_template": str(REPO / "data/chat_templates/arithmetic_tools.jinja"),
        "rollout.agent.max_turns": 3,
        "rollout.agent.max_tokens": 64,
        "annotate.teacher": str(TEACHER),
        "annotate.top_k": 8,
        "train.max_steps": 2,
        "train.global_batch_samples": 4,
        "train.lr": 1e-3,
    }
    overrides.update({f"rollout.{k}": v for k, v in rollout.items()})
    return load_config(None, overrides=overrides)


def test_require_tool_asks_again_until_a_successful_call():
    env = CalculatorEnvironment(require_tool=True)
    env.reset("What is 2 + 3?")
    assert env.step(Message("assistant", " ans= 5")) == [Message("user", REQUIRE_TOOL_REPLY)]
    assert env.step(Message("assistant", "", [ToolCall("calc", "2+3")]))[0].content == "5"
    assert env.step(Message("assistant", " #### 5")).reason == "answered"


def test_agent_rollout_annotate_and_train(local_store):
    cfg = agent_config(local_store)
    result = run_rollout(cfg, local_store)
    assert result.samples == 8 and len(result.shards) == 1
    info = local_store.shards.rollouts()[0]
    rollout, meta = read_shard(local_store, info.path, kind=ROLLOUT)
    assert meta.schema_version == 2 and "loss_mask" in rollout.schema.names
    # the demo student answers without the tool, so the environment asks again: conversations of several turns
    mask = trained_mask(rollout)
    assert 0 < mask.sum() < len(mask)
    summary = agent_summary(rollout["extra"].to_pylist())
    assert summary["conversations"] == 8, summary
    behavior = flat_values(rollout["behavior_logprobs"])
    assert np.all(behavior[~mask] == 0) and np.all(behavior[mask] < 0)
    extra = json.loads(rollout["extra"][0].as_py())
    assert {"a", "b"} <= extra.keys() and extra["agent"]["turns"] >= 1  # the prompt's extra_info is kept

    run_annotate(cfg, local_store)
    part, _ = read_shard(local_store, layout.annotated_path(info.shard_id, "teacher"))
    np.testing.assert_array_equal([len(x) for x in part["teacher_token_logprob"].to_pylist()], trained_lengths(rollout))
    # the teacher saw the whole conversation: its entries are a direct forward's at the trained positions
    teacher = load_causal_lm(TEACHER)
    for row in range(rollout.num_rows):
        prompt = rollout["prompt_ids"][row].as_py()
        response = rollout["response_ids"][row].as_py()
        keep = np.ones(len(response), bool)
        if rollout["loss_mask"][row].is_valid:
            keep = np.asarray(rollout["loss_mask"][row].as_py()) == 1
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([prompt + response])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)[torch.from_numpy(keep)]
        sampled = torch.tensor(response)[torch.from_numpy(keep)]
        expected = logprobs.gather(1, sampled[:, None]).squeeze(1)
        got = torch.tensor(part["teacher_token_logprob"][row].as_py())
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        top = torch.tensor(part["teacher_topk_logprobs"][row].as_py())
        torch.testing.assert_close(top, logprobs.topk(8, -1).values, rtol=1e-4, atol=1e-4)

    trained = run_train(cfg, local_store)
    assert trained.step == 2


def test_agent_config_errors_name_the_key(tokenizer):
    def sampler(student_topk=0, **agent):
        base = dict(environment="calculator", chat_template=str(REPO / "data/chat_templates/arithmetic_tools.jinja"))
        return AgentSampler.from_config(AgentConfig(**{**base, **agent}), tokenizer, 10, student_topk)

    assert sampler().limits.max_new_tokens == 10
    with pytest.raises(ValueError, match=r"rollout.agent.chat_template missing.jinja: no such file"):
        sampler(chat_template="missing.jinja")
    with pytest.raises(ValueError, match=r"rollout.agent.environment_options .*unexpected keyword argument 'nope'"):
        sampler(environment_options={"nope": 1})
    with pytest.raises(ValueError, match=r"student_topk > 0 \(union support\) is not supported with rollout.agent"):
        sampler(student_topk=2)


@pytest.mark.slow  # the example's whole pipeline (`opd run`) and its evaluation, 3-8 min on 2 cores: .ci/run's -m slow
def test_the_agent_example_learns_the_tool_from_the_teacher(tmp_path, monkeypatch):
    """Issue #28's bar: after `opd run` of the example, the student's greedy conversations on held-out prompts
    reach ≥ 80% of the teacher's tool-call success and final-answer (strict) accuracy, and the KL at its trained
    positions falls ≥ 5× (opd_cache/evaluate_agent.py). The student starts at 0 on both: greedy, it never calls
    the tool."""
    from opd_cache.evaluate_agent import evaluate_agent_run, format_table

    config = REPO / "examples/arithmetic_agent_cpu/config.yaml"
    store_dir = tmp_path / "store"
    command = [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(config), "--store", str(store_dir)]
    tic = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"opd run: {time.monotonic() - tic:.0f} s")
    store = Store(store_dir)
    rows = masked = 0
    for info in store.shards.rollouts():
        rollout, _ = read_shard(store, info.path, kind=ROLLOUT)
        if "loss_mask" not in rollout.schema.names:
            rows += rollout.num_rows
            continue
        # a conversation with environment text between its turns has a mask with zeros; one that ended in its
        # first turn (an answer cut by the turn limit) has none (null: every token trained)
        with_env = rollout["loss_mask"].is_valid().to_numpy(zero_copy_only=False)
        lengths = np.diff(rollout["response_ids"].combine_chunks().offsets)
        assert np.all(trained_lengths(rollout)[with_env] < lengths[with_env])
        rows, masked = rows + rollout.num_rows, masked + int(with_env.sum())
    assert masked >= 0.8 * rows, (masked, rows)  # most conversations have environment text: the tool loop ran

    monkeypatch.chdir(REPO)  # the config's paths are relative to the repository root
    cfg = load_config(str(config), overrides={"store.uri": str(store_dir)})
    report = evaluate_agent_run(cfg, str(REPO / "data/arithmetic/test.parquet"), max_prompts=200, device="cpu")
    table = format_table(report)
    print(table)
    teacher, before = report["teacher"], report["before"]
    assert teacher["tool_success"] >= 0.95 and teacher["strict"] >= 0.9, table  # the teacher shows the way
    assert before["tool_success"] == 0.0 and before["strict"] == 0.0, table  # the student starts without it
    assert report["bar"]["passed"], table


def test_writer_conversations_annotate_and_train_exactly_once(local_store, tokenizer):
    """An external agent loop's rows (RolloutWriter, rendered conversations with masks) train like opd rollout's."""
    from opd_cache import RolloutWriter
    from opd_cache.rollout.conversation import ChatRenderer, render_conversation
    from opd_cache.train.checkpoint import verify_ledger

    renderer = ChatRenderer.from_file(tokenizer, REPO / "data/chat_templates/arithmetic_tools.jinja")
    rng = np.random.default_rng(0)
    with RolloutWriter(local_store, tokenizer, student=str(STUDENT), worker_id="agent0", flush_rows=4) as writer:
        for i in range(8):
            a, b = (int(x) for x in rng.integers(10, 99, size=2))
            row = render_conversation(
                renderer,
                [
                    Message("user", f"What is {a} + {b}?"),
                    Message("assistant", "", [ToolCall("calc", f"{a}+{b}")]),
                    Message("tool", str(a + b)),
                    Message("assistant", f" #### {a + b}"),
                ],
            )
            logprobs = np.where(row.loss_mask == 1, -0.5, 0.0)  # a producer's own behavior log-probs
            writer.append_conversation(row, behavior_logprobs=logprobs, ground_truth=str(a + b))
    assert writer.shards == ["v000000-agent0-000000", "v000000-agent0-000001"]
    cfg = agent_config(local_store)
    run_annotate(cfg, local_store)
    for shard_id in writer.shards:
        rollout, _ = read_shard(local_store, layout.rollout_path(shard_id))
        part, _ = read_shard(local_store, layout.annotated_path(shard_id, "teacher"))
        np.testing.assert_array_equal(list_lengths(part["teacher_token_logprob"]), trained_lengths(rollout))
        assert np.all(trained_lengths(rollout) < list_lengths(rollout["response_ids"]))  # "= 85\n" untrained
    assert run_train(cfg, local_store).step == 2
    ledger = verify_ledger(local_store)
    assert ledger["trained"] == 8 and not ledger["duplicates"], ledger
