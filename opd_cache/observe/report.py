"""`opd report`: PNG plots and a markdown summary of a run, from its metrics files alone.

Reads `metrics/train-*.jsonl`, `metrics/rollout-*.jsonl`,
`metrics/annotate-*.jsonl` and `metrics/eval-*.jsonl`, so it works on any
store, local or remote, finished or still running.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from opd_cache.observe.metrics import read_metrics
from opd_cache.storage.store import Store

# The loss diagnostics plotted in mass_overlap.png, with the words of its legend. "Stored top-k" is the support S
# of the loss: the teacher's top-k ids kept by `opd annotate` (plus the student's top-k with --support union).
DIAGNOSTICS = {
    "teacher_mass_support": "teacher mass on stored top-k",
    "student_mass_support": "student mass on stored top-k",
    "teacher_tail_mass": "teacher mass outside it (tail)",
    "student_tail_mass": "student mass outside it (tail)",
    "topk_overlap": "top-k overlap (share of teacher's top-k in student's)",
}
# The accuracy plot's two curves: (eval key, matplotlib format, style). Strict and lenient often coincide (both
# 1.0 at the end): lenient as large open squares on a dashed line, strict as small filled dots on a solid one
# drawn on top, so both stay visible where they overlap.
ACCURACY_LINES = (
    (
        "lenient",
        "s--",
        dict(
            label="lenient accuracy (last number)",
            color="tab:orange",
            markersize=9,
            markerfacecolor="none",
            markeredgewidth=1.5,
        ),
    ),
    ("strict", "o-", dict(label="strict accuracy (#### N)", color="tab:blue", markersize=4.5)),
)
SMOOTHING_STEPS = 20  # rolling-mean window of the noisy per-step curves (the trainer's waiting share)


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


def rolling_mean(y: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last `window` values at each point (fewer at the start), so the curve starts with the data."""
    if len(y) == 0:
        return y
    sums = np.cumsum(np.insert(np.asarray(y, dtype=float), 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - window, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


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
        # the share of the trainer's wall time spent waiting for data (step_time_s excludes the wait)
        "train_data_wait_share": wait / (step_time + wait) if step_time + wait > 0 else None,
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
    import matplotlib.ticker

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = read_metrics(store)
    train = _records(metrics, "train")
    evals = sorted(_records(metrics, "eval"), key=lambda r: r["version"])
    summary = summarize(store)
    plots = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")  # legends below the axes
        plt.close(fig)
        plots.append(name)

    if train:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*_series(train, "loss"))
        ax.set(xlabel="optimizer step", ylabel="distillation loss", yscale="log", title="Distillation loss")
        save(fig, "loss.png")

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, label in DIAGNOSTICS.items():
            pairs = [(r["step"], _diagnostic(r, name)) for r in train if _diagnostic(r, name) is not None]
            if pairs:
                ax.plot(*zip(*pairs), label=label, linestyle=":" if name == "topk_overlap" else "-")
        ax.set(
            xlabel="optimizer step",
            ylabel="mean over response tokens",
            ylim=(-0.02, 1.02),
            title="Probability mass on the stored top-k, and top-k overlap",
        )
        if ax.lines:  # below the axes: the curves fill the whole height
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        save(fig, "mass_overlap.png")

        hist = summary["staleness_histogram"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar([str(k) for k in hist], list(hist.values()))
        ax.set(
            xlabel="staleness (versions behind the trainer)", ylabel="trained rows", title="Staleness of trained rows"
        )
        save(fig, "staleness.png")

    if evals:
        fig, ax1 = plt.subplots(figsize=(6.5, 4))
        versions = [r["version"] for r in evals]
        for key, fmt, style in ACCURACY_LINES:
            ax1.plot(versions, [r[key] for r in evals], fmt, **style)
        ax1.set(xlabel="policy version", ylabel="accuracy", ylim=(-0.04, 1.04), title="Held-out accuracy and KL")
        handles, labels = ax1.get_legend_handles_labels()
        kls = [(r["version"], r["kl"]) for r in evals if r.get("kl") is not None]
        if kls:
            ax2 = ax1.twinx()
            ax2.plot(*zip(*kls), "k:", marker=".", label="KL(teacher‖student) per token, right axis")
            ax2.set(ylabel="KL per token", yscale="log")
            plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 0.01, 2, 6 rather than 6×10⁰
            ax2.yaxis.set_major_formatter(plain)
            kl_values = [kl for _, kl in kls if kl > 0]
            if kl_values and max(kl_values) / min(kl_values) < 30:  # within ~a decade: label the minor ticks too
                ax2.yaxis.set_minor_formatter(plain)
            else:
                ax2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            more_handles, more_labels = ax2.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        ax1.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2, frameon=False)
        save(fig, "accuracy.png")

    stage_rates = {
        "rollout": _series([r for r in _records(metrics, "rollout") if "shard" in r], "tokens_per_s", "time"),
        "annotate": _series(
            [r for r in _records(metrics, "annotate") if r.get("event") == "annotated"], "tokens_per_s", "time"
        ),
        "train": _series(train, "tokens_per_s", "time"),
    }
    if any(len(x) for x, _ in stage_rates.values()):
        t0 = min(x.min() for x, _ in stage_rates.values() if len(x))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for stage, (x, y) in stage_rates.items():
            if len(x):
                ax1.plot(x - t0, y, label=stage)
        ax1.set(xlabel="seconds since the first record", ylabel="tokens/s", yscale="log", title="Per-stage throughput")
        ax1.legend(fontsize=7)
        if train:
            pairs = [
                (r["step"], r["data_wait_s"], r["step_time_s"])
                for r in train
                if r.get("data_wait_s") is not None and r.get("step_time_s") is not None
            ]
            if pairs:
                steps, wait, step_time = (np.asarray(c, dtype=float) for c in zip(*pairs))
                share = wait / np.maximum(step_time + wait, 1e-9)
                window = min(SMOOTHING_STEPS, len(share))
                # one step waits, the next finds its batch prefetched: the raw share jumps between 0 and 1
                ax2.plot(steps, share, color="tab:blue", alpha=0.2, linewidth=0.8, label="per step")
                ax2.plot(
                    steps,
                    rolling_mean(share, window),
                    color="tab:blue",
                    linewidth=2,
                    label=f"rolling mean over {window} steps",
                )
                ax2.legend(fontsize=7)
        ax2.set(
            xlabel="optimizer step",
            ylabel="share of the step spent waiting",
            ylim=(0, 1),
            title="Trainer waiting for data",
        )
        save(fig, "throughput.png")

    lines = [f"# opd report — {store.uri}", "", *summary_lines(summary), ""]
    if summary["eval"]:
        lines += ["| version | strict | lenient | KL(teacher‖student)/token |", "|---:|---:|---:|---:|"]
        for r in summary["eval"]:
            lines.append(
                f"| {r['version']} | {_fmt(r['strict'], '.3f')} | {_fmt(r['lenient'], '.3f')} | "
                f"{_fmt(r['kl'], '.4g')} |"
            )
        lines.append("")
    lines += [f"![{p}]({p})\n\n{PLOT_CAPTIONS[p]}\n" for p in plots]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    summary["plots"] = plots
    return summary


PLOT_CAPTIONS = {
    "loss.png": "Distillation loss per optimizer step (mean over the batch's response tokens).",
    "mass_overlap.png": "The stored top-k is the support of the loss: the teacher's top-k tokens at each position "
    "(plus the student's top-k with `--support union`). Teacher mass near 1 means k is large "
    "enough; the student's mass there rises as it learns the teacher's distribution. Top-k "
    "overlap is the share of the teacher's top-k tokens that are also among the student's "
    "top-k (1 = the same candidates, in any order); it is plotted when rollout records the "
    "student's top-k (`rollout.student_topk`).",
    "staleness.png": "How many policy versions behind the trainer each trained row was sampled (bounded by "
    "the top-level `max_staleness`).",
    "accuracy.png": "Held-out accuracy of each evaluated policy version: strict parses only `#### N`, lenient the "
    "last number; the dotted line is KL(teacher‖student) per token on the right axis.",
    "throughput.png": "Tokens per second of each stage, and the share of each trainer step spent waiting for "
    f"annotated data (faint: per step; bold: rolling mean over up to {SMOOTHING_STEPS} steps).",
}


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def summary_lines(summary: dict) -> list[str]:
    """The summary as markdown bullets with rounded numbers (report.md, and `opd report` on screen)."""
    hist = summary["staleness_histogram"]
    staleness = ", ".join(f"{k} behind: {n:,} rows" for k, n in hist.items()) or "—"
    return [
        f"- optimizer steps: {summary['steps']}, trained samples: {summary['trained_samples']:,}, "
        f"expired samples: {summary['expired_samples']:,}",
        f"- distillation loss: {_fmt(summary['first_loss'], '.4g')} (first step) → "
        f"{_fmt(summary['last_loss'], '.4g')} (last step)",
        f"- staleness of trained rows (policy versions behind the trainer): {staleness}",
        f"- throughput (tokens/s, mean over records): rollout {_fmt(summary['rollout_tokens_per_s'], ',.0f')}, "
        f"annotate {_fmt(summary['annotate_tokens_per_s'], ',.0f')}, train {_fmt(summary['train_tokens_per_s'], ',.0f')}",
        f"- trainer time spent waiting for data: {_fmt(summary['train_data_wait_share'], '.0%')}",
    ]
