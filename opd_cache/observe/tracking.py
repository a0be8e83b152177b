"""Experiment trackers (`train.report_to`): TensorBoard and Weights & Biases receive the metrics as they are logged.

The store's `metrics/*.jsonl` stay the record every stage writes and `opd report` reads; a tracker is a live
view of the same numbers for people who already use one. Two processes log to it:

* the trainer (job `train`, x-axis: optimizer step): every numeric field of its step record as `train/<key>`
  (loss, tokens/s, samples, lr, grad norm, data wait, the loss diagnostics), the staleness histogram as
  `train/staleness_mean` and `train/staleness_max`, and `train/trained_samples` (cumulative);
* the evaluator of `opd run` (job `eval`, x-axis: policy version): `eval/strict`, `eval/lenient`, `eval/kl`.

Where the files go: TensorBoard writes `<store>/metrics/tensorboard/` (the evaluator into its `eval/` folder;
`./tensorboard/<run_id>/` for a remote store). W&B runs are named `<run_id>-train` and `<run_id>-eval` in the
group `<run_id>` of project `$WANDB_PROJECT` (default `opd_cache`); a restarted stage resumes its run. Offline
mode (`WANDB_MODE=offline`) writes under `$WANDB_DIR`, else under `<store>/metrics/` (the working folder for a
remote store); `wandb sync` uploads them later.
"""

from __future__ import annotations

import importlib.util
import os

from opd_cache.storage import layout
from opd_cache.storage.store import Store

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # name in report_to -> package it needs


def check_trackers(report_to: list[str]) -> None:
    """Fail before any model loads when a tracker's package is not installed."""
    for name in report_to:
        package = TRACKERS[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(
                f"train.report_to {name}: the {package} package is not installed: "
                f"pip install 'opd-cache[{name}]' (or pip install {package})"
            )


def train_metrics(record: dict, trained_samples: int | None = None) -> dict[str, float]:
    """A trainer step record as flat numeric tracker metrics (`train/<key>`)."""
    metrics = {f"train/{key}": value for key, value in _numbers(record).items() if key not in ("step", "time")}
    staleness = {int(k): n for k, n in (record.get("staleness") or {}).items()}
    if staleness:
        rows = sum(staleness.values())
        metrics["train/staleness_mean"] = sum(k * n for k, n in staleness.items()) / rows if rows else 0.0
        metrics["train/staleness_max"] = max(staleness)
    if trained_samples is not None:
        metrics["train/trained_samples"] = trained_samples
    return metrics


def eval_metrics(record: dict) -> dict[str, float]:
    """An evaluator record (one policy version) as `eval/<key>`."""
    return {f"eval/{key}": value for key, value in _numbers(record).items()}


def _numbers(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """Sends metrics to every tracker in `report_to` (rank 0 only); does nothing when `report_to` is empty."""

    def __init__(self, report_to: list[str], *, store: Store, run_id: str, job: str, config: dict | None = None):
        check_trackers(report_to)
        self.tensorboard = self.wandb = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # in the store when it is a local directory; an object store's events go to a local folder
            log_dir = store.local_dir(layout.metrics_dir("tensorboard")) or os.path.join("tensorboard", run_id)
            # one folder per job: TensorBoard shows the trainer and the evaluator as two runs of one experiment
            self.tensorboard = SummaryWriter(
                log_dir=str(log_dir if job == "train" else os.path.join(log_dir, job)), flush_secs=10
            )  # live: the default waits two minutes
        if "wandb" in report_to:
            import wandb

            in_store = store.local_dir(layout.metrics_dir())
            wandb_dir = os.environ.get("WANDB_DIR") or (str(in_store) if in_store is not None else None)
            if wandb_dir:
                os.makedirs(wandb_dir, exist_ok=True)
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "opd_cache"),
                id=f"{run_id}-{job}",
                name=f"{run_id}-{job}",
                group=run_id,
                job_type=job,
                dir=wandb_dir,
                config=config,
                resume="allow",
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step, commit=True)  # now, not when the next step arrives

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
