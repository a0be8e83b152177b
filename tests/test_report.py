"""`opd report`: rounded numbers in report.md and on screen, the plots beside the store (as `opd demo`), the
smoothed waiting share."""

from __future__ import annotations

import re

import numpy as np
import pytest

from opd_cache.observe.metrics import MetricsLog
from opd_cache.observe.report import rolling_mean, summarize
from opd_cache.storage.store import Store
from tests.test_cli_inspect import opd

pytest.importorskip("matplotlib")

LONG_FLOAT = re.compile(r"\d\.\d{7,}")  # e.g. 6.923056125640869 (KL 0.005512 keeps 4 digits)


def write_metrics(store: Store, steps: int = 30) -> None:
    """Metrics files as the stages write them, with the unrounded floats they log."""
    train = MetricsLog(store, "train", "0")
    for step in range(1, steps + 1):
        waited = step % 2 == 1  # every other step waits: the raw share alternates between ~0.8 and 0
        train.log(
            {
                "step": step,
                "policy_version": step,
                "loss": 6.923056125640869 / step,
                "samples": 64,
                "tokens_per_s": 8698.40955338538,
                "step_time_s": 0.25,
                "data_wait_s": 1.0 if waited else 0.0,
                "staleness": {"1": 48, "2": 16},
                "expired_total": 0,
                "teacher_mass_support": 0.9990807175636292,
                "student_mass_support": 0.5 + step / 100,
                "teacher_tail_mass": 0.0009192521101795137,
                "student_tail_mass": 0.5 - step / 100,
                "topk_overlap": 0.40427741408348083,
            }
        )
    train.flush()
    rollout = MetricsLog(store, "rollout", "w00")
    for i in range(5):
        rollout.log({"shard": f"v000000-w00-{i:06d}", "tokens_per_s": 10961.113844534882})
    rollout.flush()
    annotate = MetricsLog(store, "annotate", "teacher-0")
    annotate.log({"event": "annotated", "tokens_per_s": 13724.972131147544}, flush=True)
    evals = MetricsLog(store, "eval", "0")
    for version, strict, kl in (
        (0, 0.0, 7.246705532073975),
        (15, 1.0, 0.05526781082153320),
        (30, 1.0, 0.005512309074401855),
    ):
        evals.log({"version": version, "strict": strict, "lenient": 1.0, "kl": kl}, flush=True)


def test_report_rounds_its_numbers_and_writes_beside_the_store_like_the_demo(tmp_path):
    store = Store(tmp_path / "run" / "store")
    store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    write_metrics(store)

    out = opd("report", "--store", str(tmp_path / "run" / "store"))
    assert out.returncode == 0, out.stderr
    plots = tmp_path / "run" / "plots"  # where `opd demo --out run` puts its plots
    report = (plots / "report.md").read_text()
    for name in ("loss.png", "mass_overlap.png", "staleness.png", "accuracy.png", "throughput.png"):
        assert (plots / name).stat().st_size > 1000
        assert f"![{name}]({name})" in report
    for text in (report, out.stdout):
        assert not LONG_FLOAT.search(text), LONG_FLOAT.search(text)
        assert "distillation loss: 6.923 (first step) → 0.2308 (last step)" in text
        assert (
            "staleness of trained rows (policy versions behind the trainer): 1 behind: 1,440 rows, "
            "2 behind: 480 rows" in text
        )
        assert "rollout 10,961, annotate 13,725, train 8,698" in text
        # 15 of 30 steps waited 1 s on top of a 0.25 s step: 15 / (30 × 0.25 + 15) of the time
        assert "trainer time spent waiting for data: 67%" in text
    assert "| 30 | 1.000 | 1.000 | 0.005512 |" in report
    assert "latest eval (v30): strict 1.000, lenient 1.000, KL 0.005512" in out.stdout
    assert "Top-k overlap is the share of the teacher's top-k tokens that are also among the student's top-k" in report
    assert f"wrote {plots / 'report.md'} and 5 plots" in " ".join(out.stdout.split())

    # --out still chooses the folder
    out = opd("report", "--store", str(tmp_path / "run" / "store"), "--out", str(tmp_path / "elsewhere"))
    assert out.returncode == 0 and (tmp_path / "elsewhere" / "report.md").exists()


def test_summary_keeps_full_precision_for_scripts(tmp_path):
    store = Store(tmp_path / "store")
    store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    write_metrics(store)
    summary = summarize(store)
    assert summary["first_loss"] == 6.923056125640869  # rounding is for people; benchmarks read the summary
    assert summary["train_data_wait_share"] == pytest.approx(15 / (30 * 0.25 + 15))


def test_rolling_mean_smooths_an_alternating_share():
    share = np.array([0.8, 0.0] * 10)
    smooth = rolling_mean(share, 4)
    assert smooth[0] == pytest.approx(0.8) and smooth[1] == pytest.approx(0.4)  # fewer values at the start
    assert np.allclose(smooth[3:], 0.4)  # every full window holds two waits and two prefetched steps
    assert len(rolling_mean(np.zeros(0), 4)) == 0
