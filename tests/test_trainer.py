"""The trainer on tiny models: learning, invariances, staleness, resume after SIGKILL, the objective, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from opd_cache.cli import app
from opd_cache.config import load_config
from opd_cache.losses import LossConfig, pg_loss, token_losses
from opd_cache.models import build_tiny_model, load_causal_lm
from opd_cache.storage import layout
from opd_cache.storage.store import Store, make_shard_id
from opd_cache.testing import response_logprobs, write_synthetic_shard
from opd_cache.tokenizer import tokenizer_fingerprint
from opd_cache.train import run_train
from opd_cache.train.checkpoint import complete_states, read_ledger, verify_ledger
from opd_cache.train.microbatch import MicroBatch
from opd_cache.train.objective import DistillationObjective
from opd_cache.train.shard_data import ShardCache
from opd_cache.train.stream import ShardStream
from opd_cache.train.task_reward import score_batch
from opd_cache.train.trainer import check_inputs, learning_rate
from tests.helpers import InThread

REPO = Path(__file__).resolve().parents[1]
K = 8


@pytest.fixture(scope="module")
def teacher(tokenizer):
    """A fixed tiny teacher with confident (peaked) distributions, so there is something to distil."""
    model = build_tiny_model(vocab_size=len(tokenizer), seed=1, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture
def student_path(tiny_model_factory):
    return tiny_model_factory("student", seed=0)


def make_store(
    root: Path | Store,
    student_path: Path,
    tokenizer,
    teacher,
    *,
    shards: int,
    rows: int,
    version: int = 0,
    seq0: int = 0,
    run_extra: dict | None = None,
    top_k: int = K,
    **shard_fields,
) -> Store:
    """`shards` synthetic shards of `rows` rows, annotated by `teacher` (its `top_k` entries), sampled by the student
    (behavior log-probs of `student_path`) at policy `version`, added to the store at `root` (its run.json written or
    checked first); `shard_fields`: more of `write_synthetic_shard`'s arguments (ground truth, group size, ...)."""
    store = root if isinstance(root, Store) else Store(root)
    run = store.manifest.ensure(
        student=str(student_path),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=len(tokenizer),
        top_k=top_k,
        teachers={"teacher": "tiny-teacher"},
        **(run_extra or {}),
    )
    behavior = load_causal_lm(student_path)
    for seq in range(seq0, seq0 + shards):
        write_synthetic_shard(
            store,
            run,
            make_shard_id(version, "w00", seq),
            num_rows=rows,
            vocab_size=len(tokenizer),
            top_k=top_k,
            seed=1000 * version + seq,
            teachers={"teacher": teacher},
            behavior=behavior,
            **shard_fields,
        )
    return store


def config(store: Store, s3_endpoint: str | None = None, max_staleness: int = 100, **train):
    # lr 3e-4 unless a test needs speed: Adam divides each gradient by its own RMS, which turns float rounding of
    # near-zero gradients into updates of up to ~lr, so runs that should agree agree to ~lr/100, not to 1e-7.
    overrides = {
        "store.uri": store.uri,
        "max_staleness": max_staleness,
        "train.lr": 3e-4,
        "train.publish_every": 100,
        "train.save_every": 100,
        "train.global_batch_samples": 8,
    }
    overrides.update({f"train.{k}": v for k, v in train.items()})
    if s3_endpoint:
        overrides["store.s3_endpoint"] = s3_endpoint
    return load_config(None, overrides=overrides)


def final_weights(store: Store) -> dict[str, torch.Tensor]:
    if store.is_local:
        model = load_causal_lm(store.local_path(layout.policy_dir(store.latest_version())))
    else:
        with tempfile.TemporaryDirectory() as folder:
            model = load_causal_lm(store.download_dir(layout.policy_dir(store.latest_version()), folder))
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def metrics(store: Store) -> list[dict]:
    return [json.loads(line) for line in store.read_bytes("metrics/train-0.jsonl").decode().splitlines()]


def heldout_kl(student, teacher, tokenizer) -> float:
    """Mean full-vocabulary KL(teacher || student) over response positions of held-out random sequences."""
    rng = np.random.default_rng(12345)
    vocab = len(tokenizer)
    prompts = [rng.integers(1, vocab, size=6) for _ in range(32)]
    responses = [rng.integers(1, vocab, size=8) for _ in range(32)]
    t = torch.cat(response_logprobs(teacher, prompts, responses))
    s = torch.cat(response_logprobs(student, prompts, responses))
    return float((t.exp() * (t - s)).sum(-1).mean())


# ------------------------------------------------------------------ learning
def test_distillation_loss_and_heldout_kl_fall(tmp_path, student_path, tokenizer, teacher):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=6, rows=64)
    kl_before = heldout_kl(load_causal_lm(student_path), teacher, tokenizer)
    result = run_train(config(store, max_steps=24, global_batch_samples=16, lr=3e-3), store)
    assert result.step == 24 and result.stopped == "max_steps" and store.is_done()
    losses = [m["loss"] for m in metrics(store)]
    assert len(losses) == 24
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    kl_after = heldout_kl(
        load_causal_lm(store.local_path(layout.policy_dir(store.latest_version()))), teacher, tokenizer
    )
    assert kl_after < 0.9 * kl_before, (kl_before, kl_after)
    record = metrics(store)[-1]
    for key in (
        "grad_norm",
        "lr",
        "tokens_per_s",
        "data_wait_s",
        "staleness",
        "expired_rows",
        "teacher_mass_support",
        "student_mass_support",
        "teacher_tail_mass",
        "student_tail_mass",
        "topk_overlap",
        "loss_min",
        "loss_max",
        "k1",
    ):
        assert key in record and record[key] is not None, key
    assert 0 < record["teacher_mass_support"] <= 1 and record["loss_min"] <= record["loss"] <= record["loss_max"] + 1e-6
    progress = store.read_progress()
    assert progress["step"] == 24 and progress["consumed_samples"] == 24 * 16 and progress["expired_samples"] == 0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_size_does_not_change_the_result(tmp_path, student_path, tokenizer, teacher, aggregation):
    """Gradients are normalised by the whole step's counts, so splitting a step into micro-batches changes nothing."""
    weights, micro_batches = [], []
    for name, micro in (("one", 100_000), ("many", 24)):
        store = make_store(tmp_path / name, student_path, tokenizer, teacher, shards=1, rows=24)
        run_train(config(store, max_steps=3, micro_batch_tokens=micro, aggregation=aggregation), store)
        micro_batches.append([m["micro_batches"] for m in metrics(store)])
        weights.append(final_weights(store))
    assert set(micro_batches[0]) == {1} and min(micro_batches[1]) >= 3
    assert_same_weights(*weights)


def test_resume_with_more_steps_equals_one_longer_run(tmp_path, student_path, tokenizer, teacher):
    short = make_store(tmp_path / "short", student_path, tokenizer, teacher, shards=2, rows=20)
    run_train(config(short, max_steps=3, publish_every=2), short)
    assert short.is_done() and complete_states(short) == [3] and short.latest_version() == 2
    run_train(config(short, max_steps=5, publish_every=2), short)  # resumes at step 3, DONE removed then written again
    assert short.is_done() and short.read_progress()["step"] == 5
    straight = make_store(tmp_path / "straight", student_path, tokenizer, teacher, shards=2, rows=20)
    run_train(config(straight, max_steps=5, publish_every=2), straight)
    assert_same_weights(final_weights(short), final_weights(straight))
    assert read_ledger(short) == read_ledger(straight)
    assert [m["loss"] for m in metrics(short)] == pytest.approx([m["loss"] for m in metrics(straight)], abs=1e-6)


def test_object_store_states_upload_and_resume(s3_store, s3_endpoint, tmp_path, student_path, tokenizer, teacher):
    """On S3 (moto) the DCP state is written locally then uploaded, `_COMPLETE` last, and downloaded to resume."""
    make_store(s3_store, student_path, tokenizer, teacher, shards=1, rows=24)
    run_train(config(s3_store, s3_endpoint, max_steps=2, save_every=1, publish_every=1), s3_store)
    assert complete_states(s3_store) == [1, 2] and s3_store.latest_version() == 2
    names = {info.base_name for info in s3_store.list_files("train/state/step-000002")}
    assert {"_COMPLETE", ".metadata", "__0_0.distcp", "trainer.json", "rng-0.json"} <= names
    run_train(config(s3_store, s3_endpoint, max_steps=3, save_every=1, publish_every=1), s3_store)
    assert s3_store.read_progress()["step"] == 3 and s3_store.is_done()
    local = make_store(tmp_path / "local", student_path, tokenizer, teacher, shards=1, rows=24)
    run_train(config(local, max_steps=3, save_every=1, publish_every=1), local)
    assert_same_weights(final_weights(s3_store), final_weights(local))


# ------------------------------------------------------------------ staleness
def test_rows_older_than_the_bound_expire_and_are_never_trained(tmp_path, student_path, tokenizer, teacher):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=4, rows=8)
    result = run_train(config(store, max_steps=10, max_staleness=1, publish_every=1), store)
    # step 1 at v0 and step 2 at v1 train two shards; at v2 the other two v0 shards are too stale
    assert result.step == 2 and result.stopped == "no more admissible data" and not store.is_done()
    assert result.stop_kind == "no_data"
    trained, skipped = read_ledger(store)
    s = [make_shard_id(0, "w00", i) for i in range(4)]
    assert trained == {1: [f"{s[0]}-{i}" for i in range(8)], 2: [f"{s[1]}-{i}" for i in range(8)]}
    assert skipped == {f"{sid}-{i}": "expired" for sid in s[2:] for i in range(8)}
    progress = store.read_progress()
    assert progress["expired_samples"] == 16 and progress["consumed_samples"] == 16
    assert [m["staleness"] for m in metrics(store)] == [{"0": 8}, {"1": 8}]


def test_max_staleness_zero_waits_for_data_of_the_current_version(tmp_path, student_path, tokenizer, teacher):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=2, rows=8)
    trainer = InThread(
        lambda: run_train(
            config(store, max_steps=2, max_staleness=0, publish_every=1, follow=True, poll_seconds=0.05), store
        )
    )
    trainer.wait_until(
        lambda: store.latest_version() == 1 and store.exists(f"train/skipped/{make_shard_id(0, 'w00', 1)}.jsonl"),
        "version 1 with shard 1 expired",
    )
    time.sleep(0.5)  # the trainer must be waiting now: nothing of version 1 exists yet
    assert store.read_progress()["step"] == 1 and not store.is_done()
    make_store(store, student_path, tokenizer, teacher, shards=1, rows=8, version=1)
    trainer.join()
    assert store.is_done()
    trained, skipped = read_ledger(store)
    assert trained[2] == [f"{make_shard_id(1, 'w00', 0)}-{i}" for i in range(8)]
    assert set(skipped.values()) == {"expired"} and len(skipped) == 8
    step2 = metrics(store)[1]
    assert step2["staleness"] == {"0": 8} and step2["stream_wait_s"] >= 0.4


def test_stop_ends_a_following_trainer_published_and_saved_without_done(tmp_path, student_path, tokenizer, teacher):
    """`run_train(..., stop=event)`: a trainer waiting for data ends when the event is set, its last step published
    and saved (a later run resumes there), and it does not claim to be finished."""
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=1, rows=8)
    stop = threading.Event()
    cfg = config(store, max_steps=10, publish_every=1, follow=True, poll_seconds=0.05)
    trainer = InThread(lambda: run_train(cfg, store, stop=stop))
    trainer.wait_until(lambda: store.read_progress().get("step") == 1, "step 1")
    time.sleep(0.3)  # waiting for the data of step 2, which never comes
    stop.set()
    result = trainer.join()
    assert (result.step, result.stop_kind, result.stopped) == (1, "stop_requested", "stop requested")
    assert not store.is_done() and complete_states(store) == [1] and store.latest_version() == 1


# ------------------------------------------------------------------ SIGKILL and resume
def test_sigkill_then_resume_trains_every_row_exactly_once(tmp_path, student_path, tokenizer, teacher):
    killed = make_store(tmp_path / "killed", student_path, tokenizer, teacher, shards=5, rows=8)
    command = [
        sys.executable,
        "-m",
        "opd_cache.cli",
        "train",
        "--store",
        killed.uri,
        "--max-steps",
        "8",
        "--global-batch-samples",
        "8",
        "--lr",
        "3e-4",
        "--max-staleness",
        "100",
        "--publish-every",
        "2",
        "--follow",
        "--set",
        "train.save_every=2",
        "--set",
        "train.poll_seconds=0.1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600  # a hang guard: the event waited on is step 5's ledger file
    # five steps of data: after step 5 (state saved at 4) the trainer waits for more, holding unsaved progress
    while not killed.exists("train/consumed/step-000005.jsonl"):
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert complete_states(killed)[-1] == 4
    ledger_before, _ = read_ledger(killed)
    for seq in range(5, 8):
        write_synthetic_shard(
            killed,
            killed.manifest.require(),
            make_shard_id(0, "w00", seq),
            num_rows=8,
            vocab_size=len(tokenizer),
            top_k=K,
            seed=seq,
            teachers={"teacher": teacher},
            behavior=load_causal_lm(student_path),
        )
    # restart with the same command (in this process: a second interpreter start costs more than the test)
    out = CliRunner().invoke(app, command[3:])
    assert out.exit_code == 0, out.output
    assert "resuming from" in out.output and killed.is_done()

    straight = make_store(tmp_path / "straight", student_path, tokenizer, teacher, shards=8, rows=8)
    run_train(config(straight, max_steps=8, publish_every=2, save_every=2), straight)
    assert_same_weights(final_weights(killed), final_weights(straight))

    trained, skipped = read_ledger(killed)
    assert trained == read_ledger(straight)[0]
    assert trained[5] == ledger_before[5]  # step 5 was retrained on the same rows
    report = verify_ledger(killed)
    assert report["duplicates"] == [] and report["trained"] == 64 and not skipped
    every_row = {f"{make_shard_id(0, 'w00', s)}-{i}" for s in range(8) for i in range(8)}
    assert {sid for ids in trained.values() for sid in ids} == every_row


# ------------------------------------------------------------------ the objective
def _micro_batch(model, tokenizer, rng, n_rows=3):
    vocab = len(tokenizer)
    prompts = [rng.integers(1, vocab, size=4) for _ in range(n_rows)]
    responses = [rng.integers(1, vocab, size=int(rng.integers(2, 6))) for _ in range(n_rows)]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros(n_rows, width, dtype=torch.long)
    mask = torch.zeros(n_rows, width, dtype=torch.long)
    positions = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = np.concatenate([p, r])
        ids[i, : len(seq)] = torch.from_numpy(seq)
        mask[i, : len(seq)] = 1
        positions += [i * width + len(p) - 1 + t for t in range(len(r))]
    n = len(positions)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    teacher_lp = torch.log_softmax(torch.randn(n, vocab, generator=gen) * 3, -1)
    top = teacher_lp.topk(K, -1)
    sampled = torch.from_numpy(np.concatenate(responses).astype(np.int64))
    return MicroBatch(
        input_ids=ids,
        attention_mask=mask,
        response_positions=torch.tensor(positions),
        sampled_ids=sampled,
        behavior_logprobs=-torch.rand(n, generator=gen) * 4,
        teacher_topk_ids=top.indices,
        teacher_topk_logprobs=top.values,
        teacher_token_logprobs=teacher_lp.gather(1, sampled[:, None]).squeeze(1),
        token_weights=torch.rand(n, generator=gen),
        advantages=torch.randn(n, generator=gen),
        num_rows=n_rows,
    )


def _student_logits(model, mb):
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    return logits.flatten(0, 1)[mb.response_positions]


def test_objective_applies_truncated_importance_weights(tokenizer):
    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    mb = _micro_batch(model, tokenizer, np.random.default_rng(0))
    logits = _student_logits(model, mb)
    s = torch.log_softmax(logits, -1).gather(1, mb.sampled_ids[:, None]).squeeze(1)
    mb.behavior_logprobs = s.detach() + torch.linspace(-1.0, 1.0, len(s))  # ratios exp(s - b) from e^-1 to e
    loss, _, diagnostics = DistillationObjective(model, LossConfig(importance_cap=1.5))(mb)
    weight = torch.exp(s - mb.behavior_logprobs).clamp(max=1.5).detach()
    assert (weight < 1.5).any() and (weight == 1.5).any()  # both sides of the cap are exercised
    per_token = token_losses(logits, mb.teacher_topk_ids, mb.teacher_topk_logprobs)
    torch.testing.assert_close(loss, (mb.token_weights * weight * per_token).sum(), rtol=1e-5, atol=1e-6)
    trained = mb.token_weights != 0
    torch.testing.assert_close(diagnostics["importance_weight"], weight[trained].mean(), rtol=1e-5, atol=1e-6)
    clipped = (torch.exp(s - mb.behavior_logprobs) > 1.5)[trained].float().mean()
    torch.testing.assert_close(diagnostics["importance_clipped"], clipped)


def test_objective_adds_the_grpo_task_loss(tokenizer):
    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    mb = _micro_batch(model, tokenizer, np.random.default_rng(1))
    options = LossConfig(distill_weight=0.5, task_reward_weight=2.0, clip_low=0.2, clip_high=0.28)
    loss, _, diag = DistillationObjective(model, options)(mb)
    logits = _student_logits(model, mb)
    s = torch.log_softmax(logits, -1).gather(1, mb.sampled_ids[:, None]).squeeze(1)
    task = pg_loss(s, mb.behavior_logprobs, mb.advantages + mb.behavior_logprobs, clip_low=0.2, clip_high=0.28)
    distill = token_losses(logits, mb.teacher_topk_ids, mb.teacher_topk_logprobs)
    expected = (mb.token_weights * (0.5 * distill + 2.0 * task)).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(diag["task_loss"], (2.0 * mb.token_weights * task).sum().detach(), rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_gives_the_same_gradients(tokenizer):
    grads = []
    for checkpointing in (False, True):
        model = build_tiny_model(vocab_size=len(tokenizer), seed=4)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        objective = DistillationObjective(model, LossConfig()).train()
        loss, _, _ = objective(_micro_batch(model, tokenizer, np.random.default_rng(2)))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_task_rewards_are_group_normalised(local_store, tokenizer):
    run = local_store.manifest.ensure(
        student="s", tokenizer_fingerprint="fp", vocab_size=len(tokenizer), top_k=4, teachers={"teacher": "t"}
    )
    texts = [" #### 5", " #### 7", " #### 5", " #### 5", "so 5"]
    responses = [np.array(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=np.int32) for t in texts]
    sid = make_shard_id(0, "w00", 0)
    write_synthetic_shard(
        local_store,
        run,
        sid,
        num_rows=5,
        vocab_size=len(tokenizer),
        top_k=4,
        group_size=2,
        responses=responses,
        ground_truth=["5"] * 5,
        data_sources=["arithmetic"] * 5,
    )
    cache = ShardCache(local_store, run, ["teacher"])
    stream = ShardStream(local_store, run, cache, max_staleness=5, batch_samples=5, batch_tokens=None)
    batch = stream.next_batch(1, 0)
    rewards, advantages = score_batch(batch, cache, tokenizer)
    np.testing.assert_array_equal(rewards, [1, 0, 1, 1, 0])
    np.testing.assert_allclose(advantages, [1, -1, 0, 0, 0], atol=1e-5)  # groups (0,1), (2,3), (4)


def test_pg_loss_with_task_reward_trains_end_to_end(tmp_path, student_path, tokenizer, teacher):
    store = make_store(
        tmp_path / "store", student_path, tokenizer, teacher, shards=1, rows=8, ground_truth=["3"] * 8, group_size=4
    )
    result = run_train(config(store, max_steps=1, loss="pg", importance_cap=2.0, task_reward_weight=0.5), store)
    assert result.step == 1
    record = metrics(store)[0]
    assert np.isfinite(record["loss"]) and record["task_reward_mean"] == 0.0
    assert record["loss"] == pytest.approx(record["task_loss"] + record["distill_loss"], abs=1e-6)


def test_learning_rate_schedule():
    cfg = load_config(
        None,
        overrides={
            "train.lr": 1.0,
            "train.min_lr": 0.1,
            "train.warmup_steps": 4,
            "train.schedule": "cosine",
            "train.max_steps": 14,
        },
    ).train
    assert [learning_rate(s, cfg) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert learning_rate(9, cfg) == pytest.approx(0.55)
    assert learning_rate(14, cfg) == pytest.approx(0.1)


# ------------------------------------------------------------------ bad input: one clear message each
def run_cli(*args):
    result = CliRunner().invoke(app, ["train", *map(str, args)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.count("error:") == 1
    return result.output


def test_bad_inputs_each_get_one_message(tmp_path, student_path, tokenizer, teacher, local_store):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=1, rows=4)
    out = run_cli("--store", store.uri, "--max-staleness", "-1")
    assert "config key 'max_staleness' = -1" in out and "greater than or equal to 0" in out
    out = run_cli("--store", store.uri, "--global-batch-samples", "4", "--global-batch-tokens", "100")
    assert "give only one of them" in out
    out = run_cli("--store", store.uri, "--support", "union")
    assert "--support union needs the student's top-k ids" in out
    out = run_cli("--store", store.uri, "--loss", "k1")
    assert "--loss k1" in out and "divergence='pg'" in out
    out = run_cli("--store", store.uri, "--loss", "jsd", "--tail", "none")
    assert "tail='none'" in out
    with pytest.raises(ValueError, match="--global-batch-samples 1 is smaller than the world size 2"):
        check_inputs(config(store, global_batch_samples=1).train, store.manifest.require(), world_size=2)

    # a student whose tokenizer is not the run's
    other = Store(tmp_path / "other")
    other.manifest.ensure(
        student=str(student_path), tokenizer_fingerprint="0123456789abcdef", top_k=K, teachers={"teacher": "t"}
    )
    out = run_cli("--store", other.uri)
    assert "its tokenizer" in out and "is not the run's (0123456789abcdef" in out

    # an annotated part with another top-k than run.json
    topk = Store(tmp_path / "topk")
    run = topk.manifest.ensure(
        student=str(student_path),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        top_k=4,
        teachers={"teacher": "t"},
    )
    write_synthetic_shard(topk, run, make_shard_id(0, "w00", 0), num_rows=4, vocab_size=len(tokenizer), top_k=K)
    out = run_cli("--store", topk.uri)
    assert "teacher.arrow: annotated with top_k=8 but run.json has top_k=4" in out

    # TensorBoard is optional: asking for it without the package says what to install
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        out = run_cli("--store", store.uri, "--set", "train.tensorboard=true")
        assert "train.tensorboard needs the tensorboard package: pip install tensorboard" in out

    # a store nobody rolled out into
    out = run_cli("--store", tmp_path / "empty")
    assert "does not exist (no such folder): check the path" in out
