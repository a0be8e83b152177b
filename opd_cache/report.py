"""`opd report`: PNG plots and a markdown summary of a run, from its metrics files alone.

Reads `metrics/train-*.jsonl`, `metrics/rollout-*.jsonl`,
`metrics/annotate-*.jsonl` and `metrics/eval-*.jsonl`, so it works on any
store, local or remote, finished or still running.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from opd_cache.metrics import read_metrics
from opd_cache.store import Store

DIAGNOSTICS = ["teacher_mass_support", "student_mass_support", "teacher_tail_mass", "student_tail_mass", "topk_overlap"]


def _records(metrics: dict[str, list[dict]], stage: str) -> list[dict]:
    out = []
    for name, records in sorted(metrics.items()):
        if name.startswith(f"{stage}-"):
            out.extend(records)
    return out


def _series(records: list[dict], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    xs, ys = zip(*pairs)
    return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)


def _diagnostic(record: dict, name: str):
    """Loss diagnostics are logged flat (`topk_overlap`) or under `diag/…`; accept both."""
    return record.get(name, record.get(f"diag/{name}"))


def summarize(store: Store) -> dict:
    metrics = read_metrics(store)
    train = _records(metrics, "train")
    rollout = [r for r in _records(metrics, "rollout") if "shard" in r]
    annotate = [r for r in _records(metrics, "annotate") if r.get("event") == "annotated"]
    evals = sorted(_records(metrics, "eval"), key=lambda r: r["version"])
    staleness = Counter()
    for r in train:
        for k, v in (r.get("staleness") or {}).items():
            staleness[int(k)] += v
    step_time = sum(r.get("step_time_s", 0.0) for r in train)
    wait = sum(r.get("data_wait_s", 0.0) for r in train)
    return {
        "steps": len(train),
        "first_loss": train[0]["loss"] if train else None,
        "last_loss": train[-1]["loss"] if train else None,
        "trained_samples": sum(r.get("samples", 0) for r in train),
        "expired_samples": train[-1].get("expired_total", 0) if train else 0,
        "staleness_histogram": dict(sorted(staleness.items())),
        "train_tokens_per_s": float(np.mean([r["tokens_per_s"] for r in train])) if train else None,
        "train_data_wait_share": wait / step_time if step_time > 0 else None,
        "rollout_shards": len(rollout),
        "rollout_tokens_per_s": float(np.mean([r["tokens_per_s"] for r in rollout])) if rollout else None,
        "annotated_parts": len(annotate),
        "annotate_tokens_per_s": float(np.mean([r["tokens_per_s"] for r in annotate])) if annotate else None,
        "eval": [{k: r.get(k) for k in ("version", "strict", "lenient", "kl")} for r in evals],
    }


def write_report(store: Store, out_dir: str | Path) -> dict:
    """Write `report.md` and the PNG plots into `out_dir`; returns the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = read_metrics(store)
    train = _records(metrics, "train")
    evals = sorted(_records(metrics, "eval"), key=lambda r: r["version"])
    summary = summarize(store)
    plots = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        plots.append(name)

    if train:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*_series(train, "loss"))
        ax.set(xlabel="optimizer step", ylabel="distillation loss", yscale="log", title="Distillation loss")
        save(fig, "loss.png")

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in DIAGNOSTICS:
            pairs = [(r["step"], _diagnostic(r, name)) for r in train if _diagnostic(r, name) is not None]
            if pairs:
                ax.plot(*zip(*pairs), label=name)
        ax.set(xlabel="optimizer step", ylabel="mean over tokens", title="Teacher / student mass on the support, overlap")
        if ax.lines:
            ax.legend(fontsize=7)
        save(fig, "mass_overlap.png")

        hist = summary["staleness_histogram"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar([str(k) for k in hist], list(hist.values()))
        ax.set(xlabel="staleness (versions behind the trainer)", ylabel="trained rows", title="Staleness of trained rows")
        save(fig, "staleness.png")

    if evals:
        fig, ax1 = plt.subplots(figsize=(6, 3.5))
        versions = [r["version"] for r in evals]
        ax1.plot(versions, [r["strict"] for r in evals], "o-", label="strict (#### N)")
        ax1.plot(versions, [r["lenient"] for r in evals], "s--", label="lenient (last number)")
        ax1.set(xlabel="policy version", ylabel="accuracy", ylim=(-0.02, 1.02), title="Held-out accuracy and KL")
        kls = [(r["version"], r["kl"]) for r in evals if r.get("kl") is not None]
        if kls:
            ax2 = ax1.twinx()
            ax2.plot(*zip(*kls), "k:", label="KL(teacher‖student)")
            ax2.set(ylabel="KL per token", yscale="log")
            ax2.legend(loc="center right", fontsize=7)
        ax1.legend(loc="center left", fontsize=7)
        save(fig, "accuracy.png")

    stage_rates = {
        "rollout": _series([r for r in _records(metrics, "rollout") if "shard" in r], "tokens_per_s", "time"),
        "annotate": _series([r for r in _records(metrics, "annotate") if r.get("event") == "annotated"],
                            "tokens_per_s", "time"),
        "train": _series(train, "tokens_per_s", "time"),
    }
    if any(len(x) for x, _ in stage_rates.values()):
        t0 = min(x.min() for x, _ in stage_rates.values() if len(x))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
        for stage, (x, y) in stage_rates.items():
            if len(x):
                ax1.plot(x - t0, y, label=stage)
        ax1.set(xlabel="seconds since start", ylabel="tokens/s", yscale="log", title="Per-stage throughput")
        ax1.legend(fontsize=7)
        if train:
            steps, wait = _series(train, "data_wait_s")
            _, step_time = _series(train, "step_time_s")
            share = wait / np.maximum(step_time + wait, 1e-9) if len(step_time) == len(wait) else wait
            ax2.plot(steps, share)
        ax2.set(xlabel="optimizer step", ylabel="share of step", ylim=(0, 1), title="Trainer waiting for data")
        save(fig, "throughput.png")

    lines = [f"# opd report — {store.uri}", "",
             f"- optimizer steps: {summary['steps']}, trained samples: {summary['trained_samples']}, "
             f"expired samples: {summary['expired_samples']}",
             f"- distillation loss: {summary['first_loss']} → {summary['last_loss']}",
             f"- staleness of trained rows (versions: rows): {summary['staleness_histogram']}",
             f"- throughput (tokens/s): rollout {summary['rollout_tokens_per_s']}, annotate "
             f"{summary['annotate_tokens_per_s']}, train {summary['train_tokens_per_s']}; trainer data-wait share "
             f"{summary['train_data_wait_share']}", ""]
    if summary["eval"]:
        lines += ["| version | strict | lenient | KL |", "|---:|---:|---:|---:|"]
        for r in summary["eval"]:
            kl = "" if r["kl"] is None else f"{r['kl']:.4f}"
            lines.append(f"| {r['version']} | {r['strict']:.3f} | {r['lenient']:.3f} | {kl} |")
        lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    summary["plots"] = plots
    return summary
