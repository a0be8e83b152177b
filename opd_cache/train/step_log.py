"""What each optimizer step reports on rank 0: one metrics record (observe/metrics.py), the same numbers to the
experiment trackers of `train.report_to` (observe/tracking.py), and one console line."""

from __future__ import annotations

from rich.console import Console

from opd_cache.config import Config
from opd_cache.observe.metrics import MetricsLog
from opd_cache.observe.tracking import Tracker, train_metrics
from opd_cache.storage.store import Store
from opd_cache.train.loader import LoadedStep
from opd_cache.train.step_stats import StepStats
from opd_cache.train.stream import StreamCursor


def step_record(
    item: LoadedStep,
    stats: StepStats,
    cursor: StreamCursor,
    *,
    step: int,
    policy_version: int,
    lr: float,
    grad_norm: float,
    step_time: float,
    queue_wait: float,
    with_task: bool,
) -> dict:
    """The metrics record of one step: its rows, timing, stream counters, staleness and loss statistics."""
    batch = item.batch
    record = {
        "step": step,
        "policy_version": policy_version,
        "trained_version": batch.version,
        "lr": lr,
        "grad_norm": grad_norm,
        "samples": batch.num_rows,
        "input_tokens": int((batch.prompt_lengths + batch.response_lengths).sum()),
        "micro_batches": len(item.micro_batches),
        "step_time_s": step_time,
        "tokens_per_s": stats.tokens / step_time if step_time > 0 else 0.0,
        "data_wait_s": queue_wait,
        "stream_wait_s": batch.wait_seconds,
        "decode_s": item.decode_seconds,
        "expired_rows": batch.expired_rows,
        "expired_total": cursor.expired_samples,
        "lost_total": cursor.lost_samples,
        "lost_shards": cursor.lost_shards,
        "staleness": batch.staleness_histogram(),
        **stats.record(with_task=with_task),
    }
    if with_task:
        record["task_reward_mean"] = float(batch.rewards.mean()) if batch.rewards is not None else None
    return record


class StepLog:
    """Rank 0's step reports. Opening it drops the records of steps after `resumed_step` (this run logs them
    again)."""

    metrics: MetricsLog  # metrics/train-0.jsonl
    tracker: Tracker | None  # train.report_to; None without trackers
    console: Console | None  # one line per step; None: none

    def __init__(
        self,
        store: Store,
        config: Config,
        run_id: str,
        *,
        resumed_step: int,
        console: Console | None,
        staleness: bool = True,
    ):
        self.metrics = MetricsLog(store, "train", "0")
        self.metrics.rewrite(lambda record: record.get("step", 0) <= resumed_step)
        report_to = config.train.report_to
        self.tracker = (
            Tracker(report_to, store=store, run_id=run_id, job="train", config=config.model_dump(mode="json"))
            if report_to
            else None
        )
        self.console = console
        self.staleness = staleness  # the line's staleness and expired counts (a replay has neither)
        self.max_steps = config.train.max_steps

    def log(self, record: dict, trained_samples: int) -> None:
        record["cpu_s"] = self.metrics.cpu_lap()  # since the previous step: its loader and publisher threads too
        self.metrics.log(record)
        if self.tracker is not None:  # the same numbers, live
            self.tracker.log(train_metrics(record, trained_samples), record["step"])
        if self.console:
            line = (
                f"step {record['step']:>5}/{self.max_steps} v{record['policy_version']} "
                f"loss {record['loss']:.4f} gnorm {record['grad_norm']:.3f} lr {record['lr']:.2e} "
                f"{record['tokens_per_s']:,.0f} tok/s wait {record['data_wait_s']:.2f}s"
            )
            if self.staleness:
                stale = " ".join(f"{k}:{v}" for k, v in record["staleness"].items())
                line += f" staleness[{stale}] expired {record['expired_total']}"
            self.console.print(line, highlight=False, soft_wrap=True)

    def close(self) -> None:
        self.metrics.flush()
        if self.tracker is not None:
            self.tracker.close()
