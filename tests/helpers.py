"""Helpers several test files share: the tiny `opd run` configuration, a stage running in a thread, a truncated
packed part.

Fixtures live in tests/conftest.py; synthetic shards in opd_cache/testing.py (benchmarks use them too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO


def tiny_run_config(
    store_uri: str,
    *,
    steps: int,
    batch: int,
    evaluate: bool = False,
    poll_seconds: float | None = None,
    max_staleness: int | None = None,
    **sections: dict,
) -> dict:
    """The tiny `opd run` of the tests: the shipped demo models on the arithmetic task, `steps` optimizer steps of
    `batch` samples, one shard per batch, at most three batches ahead, a version every 2 steps.

    `evaluate`: also an evaluator on 16 held-out prompts. `poll_seconds`: how often rollout, annotate and the
    trainer look at the store while they follow it (default: each stage's own). `max_staleness`: the top-level
    bound (default: the configuration's). `sections`: keys that replace or add to a section's
    (one level: `rollout={"sampling": {...}}` replaces the whole `sampling`), e.g. `train={"save_every": 3}`.
    """
    config = {
        "store": {"uri": store_uri},
        "rollout": {
            "student": str(REPO / "data/models/student"),
            "prompts": str(REPO / "data/arithmetic/train.parquet"),
            "n": 4,
            "batch_prompts": 4,
            "flush_rows": batch,
            "max_buffer_samples": 3 * batch,
            "sampling": {"max_new_tokens": 10},
        },
        "annotate": {"teacher": str(REPO / "data/models/teacher"), "top_k": 8},
        "train": {"max_steps": steps, "global_batch_samples": batch, "lr": 1e-3, "publish_every": 2, "save_every": 2},
        "run": {"evaluate": evaluate},
    }
    if evaluate:
        config["eval"] = {
            "prompts": str(REPO / "data/arithmetic/test.parquet"),
            "max_prompts": 16,
            "max_new_tokens": 10,
        }
    if max_staleness is not None:
        config["max_staleness"] = max_staleness
    if poll_seconds is not None:
        for stage in ("rollout", "annotate", "train"):
            config[stage]["poll_seconds"] = poll_seconds
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def write_config(folder: Path, config: dict) -> Path:
    """`config` as `folder`/config.yaml, the file `opd run --config` reads."""
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class InThread:
    """`target()` running in a daemon thread (a trainer, a following rollout worker) while the test acts on the
    store; what it returns or raises is kept for `join`."""

    def __init__(self, target: Callable[[], Any]):
        self.target = target
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.target()
        except BaseException as e:  # re-raised by join, shown by wait_until
            self.error = e

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
        """Poll `condition()` every 0.05 s; fail, saying `what` was awaited, if the thread ends or time runs out."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.thread.is_alive(), f"the thread ended before {what}: {self.error!r}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s"
            time.sleep(0.05)

    def join(self, timeout: float = 60) -> Any:
        """Wait for `target` to return and give what it returned; its exception, if it raised, is raised here."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"still running after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.result


def truncate_packed_field(table, name: str):
    """A packed part (codec version 3) with its fixed-size struct field `name` one byte short per position, as a
    buggy or cut-off writer might leave it (the field's metadata kept)."""
    import numpy as np
    import pyarrow as pa

    from opd_cache.storage import codec

    column = table[codec.PACKED].combine_chunks()
    per_token = column.flatten()
    fields, arrays = list(per_token.type), per_token.flatten()
    i = [f.name for f in fields].index(name)
    width = fields[i].type.byte_width
    cut = np.frombuffer(arrays[i].buffers()[1], dtype=np.uint8).reshape(-1, width)[:, :-1]
    arrays[i] = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width - 1), len(cut), [None, pa.py_buffer(cut.tobytes())]
    )
    fields[i] = fields[i].with_type(arrays[i].type)
    truncated = pa.ListArray.from_arrays(column.offsets, pa.StructArray.from_arrays(arrays, fields=fields))
    return table.set_column(1, table.schema.field(codec.PACKED).with_type(truncated.type), truncated)
