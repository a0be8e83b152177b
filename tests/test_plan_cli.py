"""`opd plan` (opd_cache/cli/plan.py): rates from flags, from a config, measured from a store; the GPU table; bad
input as one line naming the flag (or the stage whose metrics a store lacks)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from opd_cache.cli import app
from opd_cache.flow.calibrate import MissingMetricsError, calibrate
from opd_cache.observe.metrics import MetricsLog, read_metrics
from opd_cache.storage.store import Store
from tests.flow_helpers import finish_tiny_run, tiny_config

RATES = ["--rollout-samples-per-s", "500", "--annotate-samples-per-s", "600", "--train-samples-per-s", "400"]


def opd(*args) -> object:
    return CliRunner().invoke(app, ["plan", *[str(a) for a in args]])


def row(output: str, label: str) -> list[str]:
    """The cells of the table row whose first cell starts with `label`."""
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("│┃ ").split("│")]
        if line.startswith("│") and cells[0].startswith(label):
            return cells
    raise AssertionError(f"no row {label!r} in:\n{output}")


def percent(cell: str) -> float:
    return float(cell.rstrip("%")) / 100


def assert_refused(result, message: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert message in result.stderr, result.stderr


# ---------------------------------------------------------------------- inputs from flags and from a config
def test_plan_from_flags_compares_both_pacings():
    result = opd(*RATES, "--steps", 200, "--batch-samples", 32, "--no-suggest")
    assert result.exit_code == 0, result.output
    assert "200 steps × 32 samples" in result.stdout
    count, schedule = row(result.stdout, "today's pacing"), row(result.stdout, "admission by schedule")
    assert percent(schedule[3]) == 0.0  # nothing expires by schedule
    assert schedule[5] == "1.00×" and float(count[5].rstrip("×")) >= 1.0
    assert "rollout workers 1, annotate workers 1" in result.stdout


def test_plan_from_a_config_with_token_rates_and_a_suggestion(tmp_path):
    config = tiny_config(tmp_path, steps=120, batch=16)
    result = opd(
        "--config", config,
        "--rollout-tokens-per-s", 2000, "--response-tokens", 10,
        "--annotate-tokens-per-s", 9000, "--prompt-tokens", 20,
        "--train-tokens-per-s", 20000,
        "--seeds", 1,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "120 steps × 16 samples" in result.stdout
    # rollout makes 2000 / 10 = 200 samples/s; the trainer takes 20000 / 30 = 667: rollout must grow
    suggested = re.search(r"suggested .*?: rollout workers (\d+), annotate workers (\d+)", result.stdout)
    assert suggested, result.stdout
    assert int(suggested.group(1)) >= 3


def test_the_gpu_table_sizes_rollout_and_annotate_for_each_trainer():
    result = opd("--gpus", "1,4", "--batch-samples", 256, "--steps", 120)
    assert result.exit_code == 0, result.output
    assert "assumed on paper" in result.stdout
    one, four = row(result.stdout, "1"), row(result.stdout, "4")
    # four times the trainer's speed needs more rollout and annotate GPUs to keep it busy
    assert int(four[1]) > int(one[1]) and int(four[2]) > int(one[2])
    assert percent(four[5].split()[0]) >= 0.95 and percent(four[6]) <= 0.01


# ---------------------------------------------------------------------- measured from a store
@pytest.fixture(scope="module")
def finished_store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan-store")
    store, cfg = finish_tiny_run(folder, steps=4, batch=8)
    return store, folder / "config.yaml"


def test_plan_from_a_real_store_reads_each_stages_metrics(finished_store):
    store, config = finished_store
    measured = read_metrics(store)
    result = opd("--from-store", store.uri, "--config", config, "--no-suggest", "--seeds", 1)
    assert result.exit_code == 0, result.output
    cells = row(result.stdout, "measured (this store)")
    train = measured["train-0"]
    busy = sum(r["step_time_s"] for r in train) / sum(r["step_time_s"] + r["data_wait_s"] for r in train)
    assert percent(cells[2]) == pytest.approx(busy, abs=0.001)
    assert cells[5] == "1.00×"  # 32 sampled for 32 trained
    # the rates are the stages' own: seconds per row from the records
    calibration = calibrate(measured, calibrate_base(config))
    annotated = [r for r in measured["annotate-teacher-0"] if r.get("event") == "annotated"]
    assert calibration.spec.annotate.per_row == pytest.approx(
        sum(r["seconds"] / r["rows"] for r in annotated[1:]) / (len(annotated) - 1)
    )
    assert calibration.spec.train.per_row == pytest.approx(sum(r["step_time_s"] for r in train[1:]) / 3 / 8)
    assert calibration.spec.steps == 4 and calibration.spec.batch_samples == 8
    assert calibration.samples_per_prompt == 4 and calibration.shard_rows == 8


def test_shared_cores_are_modelled_from_each_stages_cpu_per_row(finished_store):
    """Every unit record carries the CPU its process took for it (cpu_s); with --cores the model's service
    times are those, shared among the stages computing at once, instead of wall times with a core each."""
    store, config = finished_store
    measured = read_metrics(store)
    shards = [r for r in measured["rollout-w00"] if "shard" in r]
    annotated = [r for r in measured["annotate-teacher-0"] if r.get("event") == "annotated"]
    train = measured["train-0"]
    for record in (*shards, *annotated, *train):
        assert record["cpu_s"] > 0, record  # a real lap of the process's CPU: each unit computed something

    calibration = calibrate(measured, calibrate_base(config), cores=2)
    assert calibration.spec.cores == 2
    assert calibration.spec.train.per_row == pytest.approx(sum(r["cpu_s"] / r["samples"] for r in train[1:]) / 3)
    assert calibration.spec.annotate.per_row == pytest.approx(
        sum(r["cpu_s"] / r["rows"] for r in annotated[1:]) / (len(annotated) - 1)
    )
    assert any("2 cores shared" in note for note in calibration.notes)
    assert calibrate(measured, calibrate_base(config)).spec.cores is None  # without: a core per stage, wall times

    result = opd("--from-store", store.uri, "--config", config, "--cores", "2", "--no-suggest", "--seeds", 1)
    assert result.exit_code == 0, result.output
    assert "2 cores shared" in result.stdout


def test_the_evaluator_of_opd_run_is_modelled_from_its_records(finished_store):
    """opd run's evaluator takes CPU from the stages: every eval_every-th version, the CPU (with --cores) or the
    seconds its records measured; the first evaluation, which carries its start-up, is left out."""
    store, config = finished_store
    measured = dict(read_metrics(store))
    measured["eval-0"] = [
        {"version": 0, "seconds": 5.0, "cpu_s": 6.0},
        {"version": 25, "seconds": 0.5, "cpu_s": 0.6},
        {"version": 50, "seconds": 0.7, "cpu_s": 0.8},
        {"version": 75, "seconds": 0.6, "cpu_s": 0.7},
    ]
    shared = calibrate(measured, calibrate_base(config), cores=2).spec
    assert (shared.eval_every, shared.eval_s) == (25, pytest.approx(0.7))
    assert calibrate(measured, calibrate_base(config)).spec.eval_s == pytest.approx(0.6)
    assert calibrate(read_metrics(store), calibrate_base(config), cores=2).spec.eval_every == 0  # no evaluator

    measured["eval-0"] = [{"version": v} for v in (0, 25, 50)]  # an older release: not modelled, and said so
    older = calibrate(measured, calibrate_base(config), cores=2)
    assert older.spec.eval_every == 0
    assert any("the evaluator is not modelled" in note for note in older.notes)


def test_each_stages_pickup_latency_is_measured_from_its_records(finished_store):
    """On a local store (bells): how long after a shard lands an idle annotate worker starts it (its record's time
    less its seconds) and a waiting trainer takes it (the wait's end: the previous step's record plus data_wait_s).
    Shards that landed while the stage was busy, and steps that did not wait, say nothing about it."""
    _, config = finished_store
    base = replace(calibrate_base(config), bells=True)
    shard = {"rows": 8, "tokens": 80, "tokens_per_s": 800.0, "cpu_s": 0.1}
    landings = {"a": 10.0, "b": 10.5, "c": 10.6, "d": 12.0}
    part = {"event": "annotated", "rows": 8, "seconds": 0.3, "cpu_s": 0.1}
    step = {"samples": 8, "step_time_s": 0.05, "policy_version": 0, "staleness": {"0": 8}, "cpu_s": 0.05}
    metrics = {
        "rollout-w00": [
            {**shard, "shard": name, "time": t, "cursor": i, "total_samples": 8 * i}
            for i, (name, t) in enumerate(landings.items(), 1)
        ],
        # a: the worker's first shard (its start-up: left out); b landed after a was done and started 6 ms later;
        # c landed while b was scored (a backlog: left out); d landed after c was done and started 8 ms later
        "annotate-teacher-0": [
            {**part, "shard_id": "a", "time": 10.304},
            {**part, "shard_id": "b", "time": 10.806},
            {**part, "shard_id": "c", "time": 10.906, "seconds": 0.1},
            {**part, "shard_id": "d", "time": 12.308},
        ],
        # a record is written after its wait, its compute and its bookkeeping: step 2 waited from 10.40 until
        # 10.813 (7 ms after b's part), step 3 did not wait, step 4 waited from 10.93 until 12.317 (9 ms after d's)
        "train-0": [
            {**step, "step": 1, "time": 10.40, "data_wait_s": 0.2},
            {**step, "step": 2, "time": 10.87, "data_wait_s": 0.413},
            {**step, "step": 3, "time": 10.93, "data_wait_s": 0.0},
            {**step, "step": 4, "time": 12.40, "data_wait_s": 1.387},
        ],
    }
    spec = calibrate(metrics, base).spec
    assert spec.annotate_pickup_s == pytest.approx(0.007)  # the median of 6 and 8 ms
    assert spec.train_pickup_s == pytest.approx(0.008)  # the median of 7 and 9 ms
    # without bells the model waits out the polls itself: no pickup is measured
    unrung = calibrate(metrics, replace(base, bells=False)).spec
    assert (unrung.annotate_pickup_s, unrung.train_pickup_s) == (0.0, 0.0)


def test_the_reload_latency_leaves_out_the_wait_for_the_version(finished_store):
    """A rollout worker that flushed before the next version was out waits for it: that wait is the window's, not
    the load's. A reload is timed from the later of the flush and the version's publication (the trainer's first
    record at that version)."""
    _, config = finished_store
    shard = {"rows": 8, "tokens": 80, "tokens_per_s": 800.0, "cpu_s": 0.1}
    part = {"event": "annotated", "rows": 8, "seconds": 0.05, "cpu_s": 0.1}
    step = {"samples": 8, "step_time_s": 0.1, "data_wait_s": 0.0, "staleness": {"0": 8}, "cpu_s": 0.1}
    metrics = {
        # v1 came out at 1.285, 0.285 s after the flush of 1.0: reloaded 15 ms later; v2 was out (1.9) when the
        # worker flushed at 2.0: reloaded 12 ms after the flush
        "rollout-w00": [
            {**shard, "shard": "a", "time": 1.0, "cursor": 1, "total_samples": 8},
            {"event": "reload", "policy_version": 1, "time": 1.300},
            {**shard, "shard": "b", "time": 2.0, "cursor": 2, "total_samples": 16},
            {"event": "reload", "policy_version": 2, "time": 2.012},
            {**shard, "shard": "c", "time": 2.5, "cursor": 3, "total_samples": 24},
        ],
        "annotate-teacher-0": [{**part, "shard_id": n, "time": t} for n, t in (("a", 1.1), ("b", 2.1), ("c", 2.6))],
        "train-0": [
            {**step, "step": 1, "time": 1.2, "policy_version": 0},
            {**step, "step": 2, "time": 1.285, "policy_version": 1},
            {**step, "step": 3, "time": 1.8, "policy_version": 1},
            {**step, "step": 4, "time": 1.9, "policy_version": 2},
        ],
    }
    spec = calibrate(metrics, calibrate_base(config)).spec
    assert spec.reload_latency_s == pytest.approx((0.015 + 0.012) / 2)  # not the 0.3 s the first flush waited


def test_shared_cores_need_the_cpu_of_every_stage(local_store):
    """A store of an older release has no cpu_s: --cores says so instead of modelling wall times as CPU."""
    local_store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    shard = {"shard": "v000000-w00-000000", "rows": 8, "tokens": 80, "tokens_per_s": 800.0}
    second = {**shard, "shard": "v000000-w00-000001", "tokens_per_s": 800.0}
    write_records(
        local_store,
        "rollout",
        "w00",
        [{**shard, "cursor": 2, "total_samples": 8}, {**second, "cursor": 4, "total_samples": 16}],
    )
    part = {"event": "annotated", "rows": 8, "seconds": 0.1, "tokens": 80}
    write_records(local_store, "annotate", "teacher-0", [part, part])
    step = {"samples": 8, "step_time_s": 0.2, "data_wait_s": 0.0, "policy_version": 0, "staleness": {"0": 8}}
    write_records(local_store, "train", "0", [{**step, "step": 1}, {**step, "step": 2}])
    calibrate(read_metrics(local_store), calibrate_base(None))  # wall times: fine
    with pytest.raises(MissingMetricsError, match=r"the rollout, annotate, train records have no cpu_s"):
        calibrate(read_metrics(local_store), calibrate_base(None), cores=2)


def calibrate_base(config):
    from opd_cache.cli.plan import spec_from_config
    from opd_cache.config import load_config
    from opd_cache.flow.simulate import Service

    one = Service(per_row=1.0)
    return spec_from_config(load_config(config), one, one, one)


def write_records(store: Store, stage: str, worker: str, records: list[dict]) -> None:
    log = MetricsLog(store, stage, worker)
    for record in records:
        log.log(record)
    log.flush()


def test_from_store_without_metrics_names_the_missing_stages(local_store):
    local_store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    result = opd("--from-store", local_store.uri)
    assert_refused(result, "has no metrics of rollout")
    assert "annotate" in result.stderr and "train" in result.stderr
    # rollout's records alone: annotate's and the trainer's are still missing
    write_records(
        local_store, "rollout", "w00", [{"shard": "v000000-w00-000000", "rows": 8, "tokens": 80, "tokens_per_s": 800.0}]
    )
    result = opd("--from-store", local_store.uri)
    assert_refused(result, "has no metrics of annotate (metrics/annotate-*.jsonl: no annotated records); train")
    assert "rollout (" not in result.stderr
    with pytest.raises(MissingMetricsError, match="train"):
        calibrate(read_metrics(local_store), calibrate_base(None))


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no rollout rate: give --rollout-samples-per-s or --rollout-tokens-per-s (or --from-store STORE)"),
        (RATES[:4], "no train rate: give --train-samples-per-s or --train-tokens-per-s"),
        (
            [*RATES, "--rollout-tokens-per-s", "3000"],
            "--rollout-samples-per-s and --rollout-tokens-per-s: give one rate for rollout, not both",
        ),
        (
            [*RATES[2:], "--rollout-tokens-per-s", "3000"],
            "--rollout-tokens-per-s needs --response-tokens (tokens per sample)",
        ),
        (
            [*RATES[:4], "--train-tokens-per-s", "9000", "--response-tokens", "10"],
            "--train-tokens-per-s needs --prompt-tokens (tokens per sample)",
        ),
        ([*RATES[:2], "--annotate-samples-per-s", "0", *RATES[4:]], "--annotate-samples-per-s: must be > 0"),
        (["--gpus", "8,x"], "--gpus '8,x': expected GPU counts separated by commas"),
    ],
)
def test_missing_or_contradictory_rates_are_one_line_naming_the_flag(args, message):
    assert_refused(opd(*args, "--no-suggest"), message)


def test_a_token_budget_config_needs_a_sample_count(tmp_path):
    config = tmp_path / "tokens.yaml"
    config.write_text("train:\n  global_batch_tokens: 4096\n")
    assert_refused(opd("--config", config, *RATES, "--no-suggest"), "give --batch-samples N")
    assert opd("--config", config, *RATES, "--batch-samples", 16, "--steps", 50, "--no-suggest").exit_code == 0
