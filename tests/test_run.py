"""`opd run` end to end on a tiny configuration: every stage exits 0 and the store holds what it should.

Also: `--sync` (lockstep, max_staleness 0) trains on the same number of samples as the asynchronous run;
without a terminal the run prints plain progress lines and the stage logs fill while it runs; the dashboard.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from opd_cache.observe.metrics import read_metrics
from opd_cache.storage.store import Store
from opd_cache.train.checkpoint import complete_states, read_ledger, verify_ledger
from tests.helpers import tiny_run_config, write_config

STEPS, BATCH = 4, 16


def tiny_config(tmp_path: Path, store: dict | None = None) -> Path:
    """The tiny run with an evaluator, on the store tmp_path/store or on `store` (a whole store section)."""
    config = tiny_run_config(
        str(tmp_path / "store"), steps=STEPS, batch=BATCH, evaluate=True, run={"drain_seconds": 120}
    )
    if store is not None:
        config["store"] = store
    return write_config(tmp_path, config)


@dataclass
class RunOutput:
    returncode: int
    stdout: str
    stderr: str
    stdout_before_done: str  # what stdout held at the last look before the trainer's DONE
    logs_before_done: dict[str, str]  # the stage logs then
    eval_log_behind: list[str]  # looks where the evaluator's metrics held v0 and its log did not show it yet


def opd_run(tmp_path: Path, *extra: str) -> RunOutput:
    """`opd run` with stdout and stderr to files, as under CI or nohup: no terminal, so plain progress lines.

    While it runs, the files are read every 0.2 s: what a person following the logs would see.
    """
    cmd = [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(tiny_config(tmp_path)), *extra]
    stdout, stderr, logs = tmp_path / "stdout.txt", tmp_path / "stderr.txt", tmp_path / "logs"
    store = Store(tmp_path / "store")
    seen = RunOutput(0, "", "", "", {}, [])
    with open(stdout, "w") as out, open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=tmp_path)
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            # the evaluator prints a version's line before it logs its metrics: a log that lags the metrics
            # holds its lines back (read in that order, so a look between the two writes cannot trip it)
            evaluated = {r["version"] for r in read_metrics(store, "eval").get("eval-0", [])}
            eval_log = (logs / "eval.log").read_text() if (logs / "eval.log").exists() else ""
            if 0 in evaluated and "eval v0:" not in eval_log:
                seen.eval_log_behind.append(eval_log)
            if not store.is_done():
                seen.stdout_before_done = stdout.read_text()
                seen.logs_before_done = {p.stem: p.read_text() for p in logs.glob("*.log")}
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        seen.returncode = proc.wait()
    seen.stdout, seen.stderr = stdout.read_text(), stderr.read_text()
    return seen


def exit_codes(logs: Path) -> dict[str, str]:
    """The last line of each stage's log (the stages print a one-line summary when they finish)."""
    return {p.stem: p.read_text().strip().splitlines()[-1] if p.read_text().strip() else "" for p in logs.glob("*.log")}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    return tmp, opd_run(tmp)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync")
    return tmp, opd_run(tmp, "--sync")


def assert_tiny_run_finished(store: Store) -> None:
    """What the store of a finished tiny run holds (local here, S3 in tests/test_s3_pipeline.py)."""
    assert store.is_done()
    shards = store.shards.rollouts()
    parts = store.shards.annotated_parts()
    assert len(shards) >= STEPS, "at least one shard per optimizer step"
    progress = store.read_progress()
    assert progress["step"] == STEPS and progress["consumed_samples"] == STEPS * BATCH
    assert store.policy_versions() == [1, 2] and store.latest_version() == 2  # publish_every 2 over 4 steps
    assert complete_states(store)[-1] == STEPS
    ledger, _ = read_ledger(store)
    trained = [sid for step in sorted(ledger) for sid in ledger[step]]
    assert len(trained) == STEPS * BATCH and len(set(trained)) == len(trained)
    assert not verify_ledger(store)["duplicates"]
    # every trained row was annotated by the teacher
    assert {sid.rsplit("-", 1)[0] for sid in trained} <= {s for s, teachers in parts.items() if "teacher" in teachers}
    # the evaluator scored version 0 and the published versions
    evaluations = read_metrics(store, "eval")["eval-0"]
    assert sorted(r["version"] for r in evaluations) == [0, 1, 2]
    # each evaluation's seconds and the evaluator's CPU for it: what `opd plan --from-store --cores` models
    assert all(r["seconds"] > 0 and r["cpu_s"] > 0 for r in evaluations), evaluations


def test_run_completes_and_store_holds_shards_versions_and_ledger(async_run):
    tmp, out = async_run
    assert out.returncode == 0, out.stderr + str(exit_codes(tmp / "logs"))
    assert_tiny_run_finished(Store(tmp / "store"))


def test_run_without_a_terminal_prints_progress_lines_and_fills_the_stage_logs_as_it_goes(async_run):
    tmp, out = async_run
    assert out.returncode == 0, out.stderr
    # stdout is a file: one plain line at the start, every ~10 s and at the end (no live table, no escape codes)
    assert "\x1b[" not in out.stdout
    assert re.search(r"^opd run: step \d+/4 \| \d+ samples", out.stdout_before_done, re.M), out.stdout_before_done
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"opd run: step 4/4 \| 64 samples \| loss \d+\.\d{4} \| eval v2: strict \d\.\d\d, "
        r"lenient \d\.\d\d, KL \d+\.\d{4} \| elapsed \d+:\d\d, ETA 0:00",
        last,
    ), last
    # each stage's log shows its progress while the run is going, not only a summary at exit
    logs = out.logs_before_done
    assert re.search(r"^rollout w00: \d+ samples, \d+ tok/s, policy v\d+, backlog \d+", logs["rollout-w00"], re.M), logs
    assert re.search(
        r"^annotate teacher: \d+ shards, \d+ rows, [\d,]+ tok/s, \d+ pending", logs["annotate-teacher-0"], re.M
    ), logs
    assert re.search(r"^step +\d/4 v\d loss", logs["train"], re.M), logs
    # (a 4-step run can end before the evaluator starts, so no look need fall between v0 and the end;
    # tests/test_forkserver.py shows deterministically that a stage's log is written while it runs)
    assert not out.eval_log_behind, "the evaluator's log lagged its metrics: lines held back until exit"
    assert re.search(
        r"^eval v0: strict 0\.\d{3}, lenient \d\.\d{3}, KL \d+\.\d{4} on 16 prompts",
        (tmp / "logs" / "eval.log").read_text(),
        re.M,
    )


def test_sync_trains_on_as_many_samples_as_async_and_never_stale(async_run, sync_run):
    (_, a), (tmp, s) = async_run, sync_run
    assert a.returncode == 0 and s.returncode == 0, s.stderr
    store = Store(tmp / "store")
    assert store.read_progress()["consumed_samples"] == STEPS * BATCH
    train = read_metrics(store, "train")["train-0"]
    staleness = {int(k) for r in train for k in r["staleness"]}
    assert staleness == {0}, "lockstep trains only on rows of the current version"
    # a version after every step; retention keeps the newest train.keep_versions (3) of them, and the older
    # ones the evaluator still held at the last pass (eval_every 1: it holds every version from the oldest it
    # has not evaluated yet; with the stages started at once the 4 steps can end before it evaluated v1)
    kept = store.policy_versions()
    assert store.latest_version() == STEPS and kept[-3:] == list(range(STEPS - 2, STEPS + 1)), kept
    assert kept[0] >= 1 and kept == list(range(kept[0], STEPS + 1)), kept


# --- the supervisor alone, with stand-in stage processes -------------------------------------------------


def supervise_fakes(tmp_path: Path, monkeypatch, codes: dict[str, str], max_restarts: int = 0) -> int:
    """`supervise` with stand-in stages: each named stage runs its Python snippet instead of the real command."""
    from opd_cache.config import load_config
    from opd_cache.launch import run as run_module
    from opd_cache.launch.run import StageProcess

    store_dir = tmp_path / "store"
    store_dir.mkdir()
    (store_dir / "run.json").write_text("{}")  # the non-rollout stages start once run.json exists
    cfg = load_config(tiny_config(tmp_path), overrides={"run.max_restarts": max_restarts, "run.drain_seconds": 30})
    stages = [
        StageProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log") for name, code in codes.items()
    ]
    monkeypatch.setattr(run_module, "stage_commands", lambda cfg, config_path, logs: stages)
    return run_module.supervise(cfg, tmp_path / "config.yaml", tmp_path / "logs", quiet=True)


def test_supervisor_fails_when_the_evaluator_fails_after_training_finished(tmp_path, monkeypatch, capsys):
    # The trainer finishes first; the evaluator, still scoring the last version, then exits with an error;
    # rollout stops a second later. The run fails, and ends as soon as the last stage has exited (not after
    # the 30 s drain deadline).
    start = time.monotonic()
    status = supervise_fakes(
        tmp_path,
        monkeypatch,
        {
            "rollout-w00": "import time; time.sleep(3)",
            "train": "pass",
            "eval": "import sys, time; time.sleep(2); sys.exit(3)",
        },
    )
    assert status == 1
    assert "eval exited with status 3 1 time(s)" in capsys.readouterr().err
    assert time.monotonic() - start < 15


def test_supervisor_succeeds_when_every_stage_exits_0(tmp_path, monkeypatch, capsys):
    status = supervise_fakes(
        tmp_path, monkeypatch, {"train": "import time; time.sleep(1)", "eval": "import time; time.sleep(2)"}
    )
    assert status == 0
    assert capsys.readouterr().err == ""


def test_supervisor_restarts_a_crashed_stage_then_gives_up(tmp_path, monkeypatch, capsys):
    # The trainer always crashes: started, restarted once after back-off (max_restarts 1), then failed for good.
    status = supervise_fakes(
        tmp_path,
        monkeypatch,
        {"train": "import sys; sys.exit(7)", "eval": "import time; time.sleep(60)"},
        max_restarts=1,
    )
    assert status == 1
    assert "train exited with status 7 2 time(s)" in capsys.readouterr().err


def test_dashboard_says_starting_shows_steps_elapsed_eta_and_no_raw_dicts(async_run):
    from rich.console import Console

    from opd_cache.launch.run import StageProcess, dashboard, progress_line
    from opd_cache.observe.progress import duration

    tmp, out = async_run
    store = Store(tmp / "store")
    never_started = StageProcess("annotate-teacher-0", [], tmp / "a.log")
    crashed = StageProcess("rollout-w00", [], tmp / "r.log", restarts=1, exit_codes=[1])
    done = StageProcess("train", [], tmp / "t.log", finished=True, exit_codes=[0])
    train = read_metrics(store, "train")["train-0"]
    started = train[0]["time"] - 30.0
    # as if the run had 8 steps: 4 to go at the measured rate of steps 1..4
    eta = 4 * (train[-1]["time"] - train[0]["time"]) / (train[-1]["step"] - train[0]["step"])
    console = Console(record=True, width=300, force_terminal=False)
    console.print(dashboard(store, [never_started, crashed, done], total_steps=8, started=started))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if line.count("│") >= 3}
    assert "starting" in rows["annotate-teacher-0"] and "waiting to restart" not in rows["annotate-teacher-0"]
    assert "waiting to restart" in rows["rollout-w00"]
    assert "finished" in rows["train"]
    assert re.search(r"step 4/8, version 2, 64 samples, 0 expired, loss \d+\.\d{4}, staleness \d+:\d+", rows["train"])
    assert re.search(rf"elapsed \d+:\d\d, ETA {re.escape(duration(eta))}", rows["train"]), rows["train"]
    assert not re.search(r"[{}']", console.export_text()), "no raw Python dicts or reprs"
    line = progress_line(store, 8, started, [never_started, crashed, done])
    assert re.fullmatch(
        rf"opd run: step 4/8 \| 64 samples \| loss \d+\.\d{{4}} \| eval v2: strict \d\.\d\d, lenient "
        rf"\d\.\d\d, KL \d+\.\d{{4}} \| rollout-w00 restarted 1× \| elapsed \d+:\d\d, "
        rf"ETA {re.escape(duration(eta))}",
        line,
    ), line


def test_staleness_reads_as_lag_colon_rows():
    from opd_cache.launch.run import staleness_text

    assert staleness_text({"2": 64, "0": 3, "10": 1}) == "0:3 2:64 10:1"
