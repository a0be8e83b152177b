"""Demand-aware pacing (issue #14): rollout and annotate stop once the trainer's remaining steps are covered.

The trainer publishes `samples_needed_total` (max_steps x global_batch_samples) in train/progress.json;
rollout samples, and annotate scores, only while the usable rows published so far fall short of it. A tiny
`opd run` therefore ends with generated / trained and scored / trained within 5% (the design's bound is
one batch of whole prompts per rollout worker: n - 1 samples, here 0).

    python -m tests.test_pacing    # one tiny run, its overshoot printed
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from opd_cache.rollout.pacing import BacklogGauge
from opd_cache.storage import layout
from opd_cache.storage.schema import count_rows
from opd_cache.storage.store import Store
from tests.conftest import write_random_rollout_shard
from tests.helpers import InThread, tiny_run_config, write_config
from tests.test_trainer import student_path, teacher  # noqa: F401  (fixtures)

STEPS, BATCH = 6, 8


def paced_run_config(tmp_path: Path) -> Path:
    """The tiny run without the evaluator, with a lead (max_buffer_samples) of the whole run."""
    config = tiny_run_config(
        str(tmp_path / "store"),
        steps=STEPS,
        batch=BATCH,
        rollout={"batch_prompts": 2, "max_buffer_samples": STEPS * BATCH, "sampling": {"max_new_tokens": 8}},
        max_staleness=2,
        annotate={"top_k": 4},
        train={"save_every": 3},
    )
    return write_config(tmp_path, config)


def overshoot(store: Store) -> dict:
    """Samples generated, scored and trained in a finished run, and the two ratios."""
    generated = sum(count_rows(store, s.path) for s in store.shards.rollouts())
    scored = sum(
        count_rows(store, layout.annotated_path(shard_id, teacher))
        for shard_id, teachers in store.shards.annotated_parts().items()
        for teacher in teachers
    )
    trained = store.read_progress()["trained_samples"]
    return {
        "generated": generated,
        "scored": scored,
        "trained": trained,
        "generated_per_trained": generated / trained,
        "scored_per_trained": scored / trained,
    }


def run_tiny(tmp_path: Path) -> dict:
    cmd = [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(paced_run_config(tmp_path))]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return overshoot(Store(tmp_path / "store"))


def test_a_tiny_run_generates_and_scores_at_most_five_percent_more_than_it_trains(tmp_path):
    result = run_tiny(tmp_path)
    assert result["trained"] == STEPS * BATCH
    assert result["generated_per_trained"] <= 1.05, result
    assert result["scored_per_trained"] <= 1.05, result
    progress = Store(tmp_path / "store").read_progress()
    assert progress["samples_needed_total"] == STEPS * BATCH


# ------------------------------------------------------------------ the gauge's arithmetic, without models
def publish(store: Store, *shards: tuple[str, int]) -> None:
    run = store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    for shard_id, rows in shards:
        write_random_rollout_shard(store, shard_id=shard_id, num_rows=rows, run=run)


def test_demand_counts_every_workers_rows_and_ignores_consumed_and_expired_ones(local_store):
    publish(local_store, ("v000000-w00-000000", 8), ("v000000-w01-000000", 8))
    gauge = BacklogGauge(local_store)
    assert gauge.backlog() == 16 and gauge.demand is None  # no trainer progress yet: no demand, no pacing
    local_store.write_progress(
        {"samples_needed_total": 40, "trained_samples": 0, "consumed_samples": 0, "expired_samples": 0}
    )
    gauge.backlog()
    assert gauge.demand == 40 - 16  # both workers' shards cover 16 of the 40
    # the trainer trained 8 and expired 8 (too stale): 16 rows are gone from the backlog, 32 still needed
    local_store.write_progress(
        {"samples_needed_total": 40, "trained_samples": 8, "consumed_samples": 8, "expired_samples": 8}
    )
    gauge.backlog()
    assert gauge.demand == 32
    publish(local_store, ("v000000-w01-000001", 32))
    assert gauge.backlog() == 32 and gauge.demand == 0
    local_store.write_progress(
        {"samples_needed_total": None, "trained_samples": 8, "consumed_samples": 8, "expired_samples": 8}
    )
    gauge.backlog()
    assert gauge.demand is None  # a token budget per step: the trainer cannot say how many samples it needs

    # a damaged shard moved to quarantine/ is never trained: its rows stop counting as coverage
    local_store.quarantine(layout.rollout_path("v000000-w01-000001"), "damaged")
    local_store.write_progress(
        {"samples_needed_total": 40, "trained_samples": 8, "consumed_samples": 8, "expired_samples": 8}
    )
    gauge.backlog()
    assert gauge.demand == 32


def test_annotate_scores_only_what_the_remaining_steps_need_and_rescores_a_quarantined_part(
    student_store, tokenizer, tiny_model_factory
):
    from opd_cache.annotate import run_annotate
    from opd_cache.config import AnnotateConfig, Config

    store, run = student_store, student_store.manifest.require()
    for seq in range(5):
        write_random_rollout_shard(
            store, shard_id=f"v000000-w00-{seq:06d}", num_rows=6, vocab_size=len(tokenizer), seed=seq, run=run
        )
    # the trainer trained 6 of the 18 its steps need: two more shards of 6 rows cover the rest
    store.write_progress(
        {"samples_needed_total": 18, "trained_samples": 6, "consumed_samples": 6, "expired_samples": 0}
    )
    cfg = Config(annotate=AnnotateConfig(teacher=str(tiny_model_factory("teacher", seed=1)), top_k=4))
    first = run_annotate(cfg, store)
    assert len(first.annotated) == 3, first.annotated  # the trained shard's part, and two more
    parts = store.shards.annotated_parts()
    assert len(parts) == 3
    store.quarantine(layout.annotated_path(first.annotated[-1], "teacher"), "damaged")
    again = run_annotate(cfg, store)
    assert again.annotated == [first.annotated[-1]]  # scored again: the trainer needs those rows
    store.mark_done()
    assert len(run_annotate(cfg, store).annotated) == 2  # DONE: no demand, score the rest


def test_rows_expiring_while_the_trainer_waits_stop_counting_as_coverage_during_the_wait(
    tmp_path, student_path, tokenizer, teacher
):
    """Without this the run could end in a deadlock: rollout sees its stale rows as coverage, the trainer waits."""
    from opd_cache.train import run_train
    from tests.test_trainer import config, make_store

    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=2, rows=8)
    trainer = InThread(
        lambda: run_train(
            config(store, max_steps=2, max_staleness=0, publish_every=1, follow=True, poll_seconds=0.05), store
        )
    )
    # step 1 trained shard 0 at version 0; step 2 (version 1) expires shard 1 and waits for version-1 rows
    trainer.wait_until(
        lambda: store.latest_version() == 1 and store.read_progress().get("expired_samples") == 8,
        "version 1 with shard 1 expired",
    )
    progress = store.read_progress()
    assert progress["step"] == 1 and progress["samples_needed_total"] == 16 and not store.is_done()
    gauge = BacklogGauge(store)
    # shard 1's rows are gone: the schedule (#25) admits the 8 rows step 2 still needs, 2 prompts of 4 at version 1
    assert gauge.backlog() == 0 and gauge.schedule is not None and gauge.demand is None  # the rule replaces it
    assert gauge.prompts_allowed(1, 0, n=4, max_buffer_samples=1000) == 2
    assert gauge.prompts_allowed(0, 0, n=4, max_buffer_samples=1000) == 0  # version 0 can no longer train
    make_store(store, student_path, tokenizer, teacher, shards=1, rows=8, version=1)
    trainer.join()
    assert store.is_done() and store.read_progress()["trained_samples"] == 16


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(run_tiny(Path(tmp)))
