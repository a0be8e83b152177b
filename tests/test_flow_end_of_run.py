"""The end-of-run mutual wait (issue #25, DESIGN.md §9), reproduced with the real stages.

A run trained to `max_steps` 2 (train/DONE written), then the same store continued with `max_steps` 3, the stages
started as `opd run` starts them: the supervisor announces the trainer's demand (`announce_demand`, before any
stage starts), then rollout, annotate and the trainer run with --follow. Annotate finds the previous run's
train/DONE before the new trainer has loaded its model and cleared it, and exits at once ("annotated 0 shards");
rollout samples the 8 rows the third step needs and waits ("backlog 8 (waiting for the trainer)": they cover the
demand); the trainer waits for ever for rows nobody will score. `opd run` by hand, the same way: after 90 s the
trainer was still at step 2. Under `opd run` which of annotate and the trainer looks at DONE first is a race
(annotate lost it in one run of three here); this test takes annotate's first look before the trainer starts,
the order in which the stall happens, and waits on that event, not on time.

The trainer's `idle_timeout` bounds the test: on today's code it gives up after IDLE seconds without data and
the test fails, rather than hanging. Phase 2 of #25 makes it pass (the mark comes off then): the announcement
before the stages start carries the trainer's schedule, and a train/DONE that the new max_steps makes stale no
longer ends a following stage.
"""

from __future__ import annotations

import threading

from opd_cache.config import load_config
from opd_cache.flow.demand import announce_demand
from tests.flow_helpers import finish_tiny_run
from tests.helpers import InThread

IDLE = 20.0  # seconds the trainer waits without admissible data before it gives up (the test's bound)


def test_a_finished_run_continued_with_more_steps_finishes(tmp_path):
    from opd_cache.annotate import Annotator
    from opd_cache.rollout import run_rollout
    from opd_cache.train import run_train

    store, _ = finish_tiny_run(tmp_path, steps=2, batch=8)  # run 1: 16 rows trained, train/DONE
    assert store.is_done()
    follow = ["rollout.follow=true", "annotate.follow=true", "train.follow=true"]
    cfg = load_config(tmp_path / "config.yaml", sets=["train.max_steps=3", f"train.idle_timeout={IDLE}", *follow])

    announce_demand(store, cfg.train, cfg.max_staleness)  # what `opd run` does before it starts the stages
    annotator = Annotator(cfg, store, progress=False)  # the teacher loaded: ready before the trainer
    annotating = InThread(annotator.run)
    # annotate's first look at the store: it lists the shards (it stays), or it has already left
    annotating.wait_until(
        lambda: annotator.selection.watch.polls > 0 or not annotating.thread.is_alive(),
        "annotate's first look",
        timeout=60,
    )
    stop = threading.Event()
    sampling = InThread(lambda: run_rollout(cfg, store, stop=stop))
    try:
        result = run_train(cfg, store)  # returns at max_steps, or after IDLE seconds without admissible data
    finally:
        stop.set()
        sampling.join(timeout=60)
        annotating.join(timeout=60)
    progress = store.read_progress()
    assert (result.step, result.stopped) == (3, "max_steps"), (
        f"the trainer stopped at step {result.step} ({result.stopped}); annotate scored "
        f"{len(annotating.result.annotated)} shards, rollout sampled {sampling.result.samples} rows"
    )
    assert progress["trained_samples"] == 24 and store.is_done()
