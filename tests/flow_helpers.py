"""A small finished run on a store, made by the real stages in this process (issue #25's tests).

`finish_tiny_run` runs rollout, annotate and the trainer one after the other (no --follow) on the shipped demo
models: what `opd run --config <tiny config>` leaves in its store — shards, parts, policy versions, a resume
state, train/DONE and every stage's metrics — in seconds instead of the supervisor's half minute of start-ups.
"""

from __future__ import annotations

from pathlib import Path

from opd_cache.config import Config, load_config
from opd_cache.storage.store import Store
from tests.helpers import tiny_run_config, write_config

STEPS, BATCH = 2, 8


def tiny_config(folder: Path, *, steps: int = STEPS, batch: int = BATCH, max_staleness: int = 2) -> Path:
    """The tiny run of the tests (tests/helpers.py), a version per step, polls of 0.1 s, no evaluator."""
    config = tiny_run_config(
        str(folder / "store"),
        steps=steps,
        batch=batch,
        poll_seconds=0.1,
        rollout={"batch_prompts": 2},
        train={"publish_every": 1, "save_every": 1},
    )
    return write_config(folder, {"max_staleness": max_staleness, **config})


def finish_tiny_run(folder: Path, *, steps: int = STEPS, batch: int = BATCH) -> tuple[Store, Config]:
    """Sample exactly the run's rows, score them, train `steps` steps to train/DONE; returns the store and config.

    The rows are all sampled with version 0 before any training, so the run's max_staleness is `steps`: every
    one of them can still train at the last step."""
    from opd_cache.annotate import run_annotate
    from opd_cache.rollout import run_rollout
    from opd_cache.train.trainer import run_train

    cfg = load_config(tiny_config(folder, steps=steps, batch=batch, max_staleness=steps))
    store = Store(cfg.store.uri)
    rollout = cfg.rollout.model_copy(update={"max_samples": steps * batch})
    run_rollout(cfg.model_copy(update={"rollout": rollout}), store)
    run_annotate(cfg, store)
    result = run_train(cfg, store)
    assert result.step == steps and store.is_done(), result
    return store, cfg
