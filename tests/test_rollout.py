"""`opd rollout`: shards, policy versions, resume after SIGKILL, pacing, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from opd_cache.cli import app
from opd_cache.config import Config, RolloutConfig, SamplingConfig
from opd_cache.models import load_causal_lm
from opd_cache.observe.metrics import read_metrics
from opd_cache.rollout import run_rollout
from opd_cache.rollout.prompt_stream import PromptStream, epoch_order
from opd_cache.storage.schema import ROLLOUT, read_shard, rollout_schema
from opd_cache.storage.store import Store
from opd_cache.tokenizer import tokenizer_fingerprint

REPO = Path(__file__).resolve().parents[1]


def write_prompts(path: Path, questions: list[str], chat: bool = True) -> Path:
    """A JSONL prompt file: verl's chat format (default) or plain question/answer rows."""
    with open(path, "w") as f:
        for i, q in enumerate(questions):
            if chat:
                row = {
                    "prompt": [{"role": "user", "content": q}],
                    "data_source": "toy",
                    "reward_model": {"ground_truth": str(i)},
                    "extra_info": {"index": i},
                }
            else:
                row = {"question": q, "answer": f"#### {i}"}
            f.write(json.dumps(row) + "\n")
    return path


def questions(count: int) -> list[str]:
    return [f"What is {i} + {i * 7 % 13}?" + " Think." * (i % 3) for i in range(count)]


def config(student, prompts, **overrides) -> Config:
    """A configuration whose rollout section samples `prompts` with `student` (`overrides`: more rollout keys)."""
    base = dict(
        student=str(student),
        prompts=str(prompts),
        n=2,
        sampling=SamplingConfig(max_new_tokens=8),
        flush_rows=4,
        poll_seconds=0.05,
    )
    return Config(rollout=RolloutConfig(**{**base, **overrides}))


def shards_of(store: Store, worker: str | None = None):
    run = store.manifest.require()
    out = []
    for info in store.shards.rollouts():
        if worker is None or info.worker == worker:
            table, meta = read_shard(store, info.path, kind=ROLLOUT, run=run)
            out.append((info, table, meta))
    return sorted(out, key=lambda s: s[0].seq)


def wait_for(condition, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def teacher_forced_logprobs(model, prompt_ids, response_ids) -> np.ndarray:
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)[len(prompt_ids) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(response_ids, dtype=torch.long)[:, None]).squeeze(-1).numpy()


# ---------------------------------------------------------------- shards
def test_shards_have_the_schema_version_0_n_samples_and_teacher_forced_logprobs(
    tiny_model_factory, tokenizer, local_store, tmp_path
):
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(6))
    result = run_rollout(config(student, prompts, n=3, flush_rows=6, max_samples=18), local_store)
    assert result.samples == 18 and result.cursor == 6 and len(result.shards) == 3

    run = local_store.manifest.require()
    assert run["student"] == str(student.resolve()) and run["vocab_size"] == len(tokenizer)
    assert run["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer) and "student_topk" not in run
    shards = shards_of(local_store)
    assert [s[0].shard_id for s in shards] == ["v000000-w00-000000", "v000000-w00-000001", "v000000-w00-000002"]

    model = load_causal_lm(student)
    order = epoch_order(6, 0, "w00", 0)
    templated = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions(6)
    ]
    seen = []
    for _info, table, meta in shards:
        assert table.schema.remove_metadata() == rollout_schema(0)
        assert meta.policy_version == 0 and set(table["policy_version"].to_pylist()) == {0}
        rows = table.to_pylist()
        assert len(rows) == 6
        for row in rows:
            p = row["prompt_index"]
            assert row["prompt_ids"] == tokenizer(templated[p], add_special_tokens=False)["input_ids"]
            assert row["data_source"] == "toy" and row["ground_truth"] == str(p)
            assert json.loads(row["extra"]) == {"index": p}
            np.testing.assert_allclose(
                row["behavior_logprobs"],
                teacher_forced_logprobs(model, row["prompt_ids"], row["response_ids"]),
                atol=1e-4,
                rtol=0,
            )
        # n samples per prompt, sample_index 0..n-1, whole prompts per shard
        for k in range(0, len(rows), 3):
            assert {r["prompt_index"] for r in rows[k : k + 3]} == {rows[k]["prompt_index"]}
            assert [r["sample_index"] for r in rows[k : k + 3]] == [0, 1, 2]
        seen += [r["prompt_index"] for r in rows[::3]]
    assert seen == order.tolist()  # the seeded order: every prompt once in the epoch
    sample_ids = [sid for s in shards for sid in s[1]["sample_id"].to_pylist()]
    assert len(set(sample_ids)) == 18

    records = read_metrics(local_store, "rollout")["rollout-w00"]
    assert [r["shard"] for r in records if "shard" in r] == [s[0].shard_id for s in shards]
    assert all(r["tokens_per_s"] > 0 for r in records if "shard" in r)


def test_student_topk_is_recorded_and_adopted_from_the_run(tiny_model_factory, tokenizer, local_store, tmp_path):
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(4), chat=False)
    run_rollout(config(student, prompts, student_topk=3, max_samples=4), local_store)
    assert local_store.manifest.require()["student_topk"] == 3
    # a second worker that does not ask for it follows the run's setting
    run_rollout(config(student, prompts, worker_id="w01", max_samples=4), local_store)
    for _info, table, meta in shards_of(local_store):
        assert meta.student_topk == 3 and table.schema.field("student_topk_ids").type.value_type.list_size == 3
        lengths = [len(r) for r in table["response_ids"].to_pylist()]
        assert [len(t) for t in table["student_topk_ids"].to_pylist()] == lengths


def test_flush_seconds_publishes_partial_shards(tiny_model_factory, local_store, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", questions(8))
    cfg = config(
        tiny_model_factory("student"), prompts, flush_rows=1000, flush_seconds=1e-3, batch_prompts=2, max_samples=8
    )
    result = run_rollout(cfg, local_store)
    assert [t.num_rows for _, t, _ in shards_of(local_store)] == [4, 4] and result.samples == 8


def test_one_pass_by_default_then_later_epochs_cycle_in_a_new_order(tiny_model_factory, local_store, tmp_path):
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(5))
    first = run_rollout(config(student, prompts, sampling=SamplingConfig(max_new_tokens=2)), local_store)
    assert first.cursor == 5 and first.samples == 10  # no limit given: one pass over the prompts
    assert run_rollout(config(student, prompts), local_store).samples == 0  # the pass is done
    more = run_rollout(config(student, prompts, sampling=SamplingConfig(max_new_tokens=2), max_samples=24), local_store)
    assert more.cursor == 12 and more.samples == 14
    indices = [i for _, t, _ in shards_of(local_store) for i in t["prompt_index"].to_pylist()[::2]]
    expected = np.concatenate([epoch_order(5, 0, "w00", 0), epoch_order(5, 0, "w00", 1), epoch_order(5, 0, "w00", 2)])
    assert indices == expected[:12].tolist()
    assert sorted(indices[5:10]) == list(range(5))


def test_restart_with_another_seed_is_refused(tiny_model_factory, local_store, tmp_path):
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(4))
    run_rollout(config(student, prompts, max_samples=4), local_store)
    before = sorted(p.name for p in (Path(local_store.root) / "rollouts").iterdir())
    with pytest.raises(
        ValueError,
        match=r"worker w00 was sampling with seed 0 over 4 prompts, this command has seed "
        r"1 over 4",
    ):
        run_rollout(config(student, prompts, max_samples=8, seed=1), local_store)
    assert sorted(p.name for p in (Path(local_store.root) / "rollouts").iterdir()) == before


# ---------------------------------------------------------------- policy versions and pacing
def test_one_pass_without_a_trainer_ends_and_with_a_running_trainer_paces(tiny_model_factory, local_store, tmp_path):
    """No --max-samples, --max-shards or --follow: one pass over the prompts. Run before any trainer (the README's
    stage commands, one after another) it must end although its backlog passes max_buffer_samples: nobody would
    ever consume it (it waited for ever: "backlog 4096 (waiting for the trainer)"). A trainer that has written
    train/progress.json and is not DONE is paced against as before."""
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(10))
    stop, done = threading.Event(), {}
    cfg = config(student, prompts, max_buffer_samples=3)  # 20 rows > 3, and no trainer
    worker = threading.Thread(target=lambda: done.update(r=run_rollout(cfg, local_store, stop=stop)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    ended = not worker.is_alive()
    stop.set()  # a worker still waiting stops, so the test ends either way
    worker.join(timeout=60)
    assert ended, "the one pass over the prompts did not end without a trainer"
    assert done["r"].total_samples == 20 and done["r"].cursor == 10

    store = Store(tmp_path / "paced")
    store.write_progress({"step": 0, "policy_version": 0, "consumed_samples": 0, "expired_samples": 0})
    stop, done = threading.Event(), {}
    cfg = config(student, prompts, max_buffer_samples=3, worker_id="w01")
    worker = threading.Thread(target=lambda: done.update(r=run_rollout(cfg, store, stop=stop)), daemon=True)
    worker.start()
    try:
        wait_for(lambda: len(store.shards.rollouts()) == 1, what="the first shard")
        time.sleep(1.0)  # the trainer consumes nothing: the worker must wait, not sample further
        assert len(store.shards.rollouts()) == 1 and worker.is_alive()
        store.mark_done("max_steps at step 1")  # the trainer is gone: nothing left to pace against
        worker.join(timeout=120)
    finally:
        stop.set()
    assert not worker.is_alive() and done["r"].total_samples == 20


def test_new_policy_version_is_loaded_between_batches_and_pacing_waits(tiny_model_factory, local_store, tmp_path):
    student, new_policy = tiny_model_factory("student"), tiny_model_factory("student", seed=5)
    prompts = write_prompts(tmp_path / "p.jsonl", questions(10))
    cfg = config(student, prompts, max_shards=3, max_buffer_samples=3)
    stop, result = threading.Event(), {}
    worker = threading.Thread(target=lambda: result.update(r=run_rollout(cfg, local_store, stop=stop)), daemon=True)
    worker.start()
    try:
        count = lambda: len(local_store.shards.rollouts())  # noqa: E731
        wait_for(lambda: count() == 1, what="the first shard")
        time.sleep(1.0)
        assert count() == 1, "backlog 4 > max_buffer_samples 3: the worker must wait, not produce"
        local_store.publish_policy(1, new_policy)
        local_store.write_progress({"step": 1, "policy_version": 1, "consumed_samples": 4, "expired_samples": 0})
        wait_for(lambda: count() == 2, what="the second shard")
        time.sleep(0.5)
        assert count() == 2  # paced again
        local_store.write_progress({"step": 2, "policy_version": 1, "consumed_samples": 6, "expired_samples": 2})
        worker.join(timeout=120)
    finally:
        stop.set()  # never leave the worker waiting if an assertion failed
    assert not worker.is_alive() and len(result["r"].shards) == 3 and result["r"].policy_version == 1

    shards = shards_of(local_store)
    assert [s[0].shard_id for s in shards] == ["v000000-w00-000000", "v000001-w00-000001", "v000001-w00-000002"]
    assert [s[2].policy_version for s in shards] == [0, 1, 1]
    v0, v1 = load_causal_lm(student), load_causal_lm(new_policy)
    row = shards[1][1].slice(0, 1).to_pylist()[0]
    sampled_by_v1 = teacher_forced_logprobs(v1, row["prompt_ids"], row["response_ids"])
    np.testing.assert_allclose(row["behavior_logprobs"], sampled_by_v1, atol=1e-4, rtol=0)
    sampled_by_v0 = teacher_forced_logprobs(v0, row["prompt_ids"], row["response_ids"])
    assert not np.allclose(row["behavior_logprobs"], sampled_by_v0, atol=1e-3)
    # the prompt sequence runs on across the reload
    indices = [i for s in shards for i in s[1]["prompt_index"].to_pylist()[::2]]
    assert indices == epoch_order(10, 0, "w00", 0)[:6].tolist()
    events = [r for r in read_metrics(local_store, "rollout")["rollout-w00"] if r.get("event") == "reload"]
    assert [e["policy_version"] for e in events] == [1]


def test_follow_flushes_on_stop_and_ends_at_the_done_marker(tiny_model_factory, local_store, tmp_path):
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(6))
    cfg = config(student, prompts, follow=True, flush_rows=10_000, flush_seconds=10_000, batch_prompts=2)
    stop, result = threading.Event(), {}
    worker = threading.Thread(target=lambda: result.update(r=run_rollout(cfg, local_store, stop=stop)), daemon=True)
    worker.start()
    wait_for(lambda: (Path(local_store.root) / "run.json").exists(), what="run.json")
    time.sleep(1.5)
    assert local_store.shards.rollouts() == []  # nothing is due yet
    stop.set()  # what SIGINT/SIGTERM do in the CLI
    worker.join(timeout=120)
    assert not worker.is_alive()
    ((info, table, meta),) = shards_of(local_store)
    assert table.num_rows == result["r"].samples > 0 and table.num_rows % 2 == 0
    metadata = read_shard(local_store, info.path)[0].schema.metadata
    assert metadata[b"opd.rollout.cursor"] == str(table.num_rows // 2).encode()

    local_store.mark_done()
    again = run_rollout(cfg, local_store)  # the trainer is done: a following worker exits at once
    assert again.samples == 0 and len(local_store.shards.rollouts()) == 1


def test_a_following_worker_samples_nothing_when_done_appears_after_its_last_look(
    tiny_model_factory, local_store, tmp_path
):
    """The race behind a tiny run's one extra shard (CI, session 9): `finished()` looked before the trainer wrote
    DONE, the pacing's poll right after saw DONE, which drops the schedule, and pacing by count then sampled a
    batch no step would train. A following worker now waits on DONE, and the loop ends at its next look."""
    from opd_cache.rollout.worker import RolloutWorker

    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(6))
    cfg = config(student, prompts, follow=True, batch_prompts=2, flush_rows=4)
    worker = RolloutWorker(cfg, local_store)
    local_store.mark_done()  # written by the trainer just after the worker's look
    looks, real_finished = [], worker.finished

    def finished() -> bool:  # the first look misses DONE
        looks.append(None)
        return len(looks) > 1 and real_finished()

    worker.finished = finished
    result = worker.run()
    assert len(looks) >= 2  # it looked again after the missed one
    assert result.samples == 0 and local_store.shards.rollouts() == []


# ---------------------------------------------------------------- the CLI, SIGKILL and resume
def rollout_args(store, student, prompts, *extra) -> list[str]:
    return [
        "rollout",
        "--store",
        str(store),
        "--student",
        str(student),
        "--prompts",
        str(prompts),
        "--n",
        "2",
        "--max-new-tokens",
        "12",
        "--flush-rows",
        "4",
        "--max-samples",
        "80",
        "--seed",
        "3",
        "--set",
        "rollout.batch_prompts=2",
        *extra,
    ]


def test_sigkilled_worker_resumes_with_no_repeat_and_no_gap(tiny_model_factory, tmp_path):
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(40))
    store_dir = tmp_path / "store"
    args = rollout_args(store_dir, student, prompts)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "opd_cache.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    store = Store(store_dir)
    try:
        wait_for(lambda: len(store.shards.rollouts()) >= 1 or proc.poll() is not None, what="the first shard")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == -signal.SIGKILL, output
    killed_at = len(store.shards.rollouts())
    print(f"killed after {killed_at} shards")
    assert 1 <= killed_at < 20, "the kill should land mid-run"

    restarted = CliRunner().invoke(app, args)  # the same command again
    assert restarted.exit_code == 0, restarted.output
    assert "80 samples in all, prompt cursor 40" in restarted.output

    shards = shards_of(store)
    assert [s[0].seq for s in shards] == list(range(20))  # no gap in the sequence numbers
    indices = [i for s in shards for i in s[1]["prompt_index"].to_pylist()]
    stream = PromptStream(40, 3, "w00").take(0, 40)
    assert indices == np.repeat(stream, 2).tolist()  # every prompt once, in order: no repeat, no gap
    # Batches start at the same cursors as in an uninterrupted run, so even the samples are the same.
    reference = Store(tmp_path / "reference")
    assert CliRunner().invoke(app, rollout_args(reference.root, student, prompts)).exit_code == 0
    for (_, a, _), (_, b, _) in zip(shards, shards_of(reference)):
        assert a["response_ids"].to_pylist() == b["response_ids"].to_pylist()


# ---------------------------------------------------------------- bad input: one-line error, nothing written
def snapshot(root: Path) -> dict[str, bytes]:
    return (
        {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        if root.exists()
        else {}
    )


def no_template_student(tiny_model_factory, tmp_path) -> Path:
    path = tmp_path / "base-student"
    shutil.copytree(tiny_model_factory("student"), path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config_file.write_text(
        json.dumps({k: v for k, v in json.loads(config_file.read_text()).items() if k != "chat_template"})
    )
    return path


@pytest.mark.parametrize(
    "case", ["empty", "too_long", "missing_column", "no_chat_template", "other_tokenizer", "other_student"]
)
def test_bad_input_is_a_one_line_error_and_writes_nothing(case, tiny_model_factory, tmp_path):
    student = tiny_model_factory("student")
    store = Store(tmp_path / "store")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(3))
    extra = []
    if case == "empty":
        prompts = write_prompts(tmp_path / "p.jsonl", ["What is 1 + 1?", "   ", "Hi"], chat=False)
        expected = "row 1: prompt is empty"
    elif case == "too_long":
        prompts = write_prompts(tmp_path / "p.jsonl", ["What is 1 + 1?", "x" * 50], chat=False)
        extra = ["--max-prompt-tokens", "30"]
        expected = "row 1: prompt has 51 tokens, more than max_prompt_tokens=30"
    elif case == "missing_column":
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"text": "What is 1 + 1?"}\n')
        expected = "missing column 'prompt' (verl chat messages) or 'question' (plain text); found columns: text"
    elif case == "no_chat_template":
        student = no_template_student(tiny_model_factory, tmp_path)
        expected = "holds chat messages but tokenizer"
    elif case == "other_tokenizer":
        store.manifest.ensure(student=str(student.resolve()), tokenizer_fingerprint="0123456789abcdef")
        expected = "tokenizer_fingerprint is '0123456789abcdef' in this store"
    else:
        store.manifest.ensure(student="/models/another-student")
        expected = "student is '/models/another-student' in this store"
    before = snapshot(tmp_path / "store")

    result = CliRunner().invoke(app, rollout_args(store.root, student, prompts, *extra))
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert result.output.strip().startswith("error:") and "\n" not in result.output.strip()
    assert snapshot(tmp_path / "store") == before


def test_truncate_prompts_skips_and_counts_over_long_prompts(tiny_model_factory, tmp_path):
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", ["What is 1 + 1?", "x" * 50, "Hi"], chat=False)
    store = Store(tmp_path / "store")
    result = CliRunner().invoke(
        app,
        [
            "rollout",
            "--store",
            str(store.root),
            "--student",
            str(student),
            "--prompts",
            str(prompts),
            "--max-prompt-tokens",
            "30",
            "--truncate-prompts",
            "--max-new-tokens",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "skipped 1 prompts over 30 tokens" in result.output
    indices = {i for _, t, _ in shards_of(store) for i in t["prompt_index"].to_pylist()}
    assert indices == {0, 2}  # prompt_index is the row in the prompt file
