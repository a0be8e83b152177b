"""`train.report_to`: the trainer's and the evaluator's metrics reach TensorBoard and W&B (offline) files.

The W&B test reads the run's own `.wandb` file (a LevelDB-style log of protobuf records, the file `wandb sync`
uploads) and compares every logged value with the store's metrics/*.jsonl.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
from pathlib import Path

import pytest
import torch

from opd_cache.config import load_config
from opd_cache.models import build_tiny_model
from opd_cache.observe.metrics import read_metrics
from opd_cache.observe.tracking import check_trackers, train_metrics
from opd_cache.train import run_train
from tests.test_cli_inspect import opd
from tests.test_trainer import config, make_store

REPO = Path(__file__).resolve().parents[1]
STEPS = 4


@pytest.fixture(scope="module")
def trained_store(tmp_path_factory, tiny_model_factory, tokenizer):
    """A tiny run trained for STEPS steps with report_to [wandb, tensorboard], W&B offline under a tmp folder."""
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    tmp_path = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as env:  # offline: nothing leaves the machine; the files stay in tmp
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
        env.setenv("WANDB_SILENT", "true")
        teacher = build_tiny_model(vocab_size=len(tokenizer), seed=1, tie_word_embeddings=False)
        store = make_store(
            tmp_path / "store", tiny_model_factory("student", seed=0), tokenizer, teacher, shards=2, rows=16
        )
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # shared cores: torch's thread pool makes tiny models slower, not faster
        try:
            result = run_train(
                config(store, max_steps=STEPS, publish_every=2, report_to=["wandb", "tensorboard"]), store
            )
        finally:
            torch.set_num_threads(threads)
        assert result.step == STEPS
        yield store, tmp_path / "wandb-dir"


def wandb_history(wandb_dir: Path, run_name: str) -> list[dict]:
    """The history rows (one per logged step) of an offline W&B run, read from its .wandb file.

    W&B's service process (wandb-core) writes that file and closes it when its stream is torn down, which
    `run.finish()` does not wait for: on a busy machine the file read right after `finish()` still held only its
    7-byte header (no rows). `wandb.teardown()` stops the service and returns once every file is written."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # this process's runs (trainer, in-process `opd eval`) are finished: flush their files

    files = glob.glob(str(wandb_dir / "wandb" / f"offline-run-*-{run_name}" / f"run-{run_name}.wandb"))
    assert len(files) == 1, files
    data = Path(files[0]).read_bytes()
    block, header = 32768, struct.Struct("<IHB")  # LevelDB log: crc32c, length, type (1 full, 2 first, 3, 4 last)
    assert data[:4] == b":W&B"
    pos, pending, rows = 7, b"", []
    while pos + header.size <= len(data):
        left = block - pos % block
        if left < header.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = header.unpack_from(data, pos)
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + header.size : pos + header.size + length]
        pos += header.size + length
        if kind in (1, 4):  # a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def test_trainer_metrics_reach_wandb_offline_and_tensorboard(trained_store):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store, wandb_dir = trained_store
    records = read_metrics(store, "train")["train-0"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    run_id = store.manifest.read()["run_id"]

    history = {row["_step"]: row for row in wandb_history(wandb_dir, f"{run_id}-train")}
    assert sorted(history) == list(range(1, STEPS + 1))
    trained = 0
    for r in records:
        trained += r["samples"]
        row = history[r["step"]]
        for key in (
            "loss",
            "tokens_per_s",
            "samples",
            "lr",
            "grad_norm",
            "data_wait_s",
            "policy_version",
            "teacher_mass_support",
        ):
            assert row[f"train/{key}"] == pytest.approx(r[key], rel=1e-12), key
        assert row["train/trained_samples"] == trained
        assert row["train/staleness_mean"] == pytest.approx(train_metrics(r)["train/staleness_mean"])

    events = EventAccumulator(str(store.local_path("metrics/tensorboard")))
    events.Reload()
    assert {"train/loss", "train/tokens_per_s", "train/samples", "train/staleness_mean"} <= set(
        events.Tags()["scalars"]
    )
    tb_loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert tb_loss == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)  # float32 in event files


def follow_with_wandb(store) -> list[str]:
    """`opd eval` following the run in `store` on 4 test prompts (6 new tokens each), logging to W&B."""
    prompts = ["--prompts", str(REPO / "data/arithmetic/test.parquet"), "--max-prompts", "4", "--max-new-tokens", "6"]
    return ["eval", "--model", store.uri, "--follow", *prompts, "--set", "train.report_to=wandb"]


def test_evaluator_logs_strict_lenient_and_kl_to_its_own_wandb_run(trained_store):
    store, wandb_dir = trained_store
    out = opd(*follow_with_wandb(store), "--teacher", str(REPO / "data/models/teacher"))
    assert out.returncode == 0, out.stdout + out.stderr
    evals = {r["version"]: r for r in read_metrics(store, "eval")["eval-0"]}
    assert sorted(evals) == [0, 1, 2]
    history = {row["_step"]: row for row in wandb_history(wandb_dir, f"{store.manifest.read()['run_id']}-eval")}
    assert sorted(history) == [0, 1, 2]
    for version, r in evals.items():
        for key in ("strict", "lenient", "kl"):
            assert history[version][f"eval/{key}"] == pytest.approx(r[key], rel=1e-12), (version, key)


def test_report_to_accepts_names_and_keeps_the_tensorboard_flag():
    assert load_config(None, sets=["train.report_to=wandb"]).train.report_to == ["wandb"]
    assert load_config(None, sets=["train.report_to=wandb,tensorboard"]).train.report_to == ["wandb", "tensorboard"]
    assert load_config(None, sets=["train.tensorboard=true"]).train.report_to == ["tensorboard"]  # deprecated alias
    assert load_config(None, sets=["train.tensorboard=true", "train.report_to=[tensorboard]"]).train.report_to == [
        "tensorboard"
    ]
    with pytest.raises(
        ValueError,
        match=r"train.report_to.0' = 'mlflow' \(from --set train.report_to=mlflow\): Input should be 'tensorboard' or",
    ):
        load_config(None, sets=["train.report_to=mlflow"])


def test_a_missing_tracker_package_is_named_before_training(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(
        ValueError,
        match=r"train.report_to wandb: the wandb package is not installed: "
        r"pip install 'opd-cache\[wandb\]'",
    ):
        check_trackers(["tensorboard", "wandb"])


def test_an_evaluator_stopped_by_sigterm_keeps_its_wandb_rows(trained_store, tmp_path):
    """`opd run` stops the evaluator with SIGTERM: what it had logged is in the W&B files (closed, not killed)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from opd_cache.storage.store import Store

    source, _ = trained_store
    store = Store(shutil.copytree(source.local_path("."), tmp_path / "store"))
    store.delete("train/DONE")  # training "still running": the evaluator follows until it is stopped
    store.delete("metrics/eval-0.jsonl")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-dir"), "WANDB_SILENT": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "opd_cache.cli", *follow_with_wandb(store)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def eval_rows() -> int:
        return len(read_metrics(store, "eval")["eval-0"]) if store.exists("metrics/eval-0.jsonl") else 0

    try:
        # The event is the third eval row: on a loaded machine it took over two minutes (a stress run at load 11
        # stopped it after one row when this waited 120 s). The hang guard only stops a broken evaluator.
        hang_guard = time.monotonic() + 900
        while eval_rows() < 3 and proc.poll() is None and time.monotonic() < hang_guard:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        assert eval_rows() == 3, "the evaluator logged fewer than 3 rows in 900 s"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, output  # "interrupted", after closing the tracker
    history = wandb_history(tmp_path / "wandb-dir", f"{store.manifest.read()['run_id']}-eval")
    assert [row["_step"] for row in history] == [0, 1, 2]
