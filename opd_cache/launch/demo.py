"""`opd demo`: on-policy distillation that visibly works, on a 2-core CPU, in minutes.

The story (faithful to verl's OPD results on GSM8K): the student already adds
two-digit numbers but writes " ans= 85", so the strict GSM8K parser (`#### N`)
scores it near 0 while a lenient parser (last number) finds it right. The
teacher writes " #### 85". On-policy distillation alone — no task reward —
teaches the student the teacher's format: strict accuracy rises to the
teacher's and the teacher–student KL collapses.

Steps: (0) every import the demo needs, and an --out that holds no other run
(`--overwrite` replaces the previous one), (1) the tiny models shipped in data/models (in a checkout
without them: train them once and cache them), (2) the teacher's own accuracy, (3) `opd run` on
`examples/arithmetic_cpu/config.yaml` with an evaluator scoring every few versions, (4) a before/after
table, `summary.json` and the report's plots. The config, prompts and models come from the checkout or,
installed, from the package's copies (`opd_cache/launch/demo_assets.py`).

`engine="vllm"` (`opd demo --engine vllm`) samples and scores with vLLM instead: the same models with their
attention heads zero-padded to a size vLLM's CPU attention accepts (the same function), built into --out.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from opd_cache.config import Config, load_config
from opd_cache.launch.demo_assets import DEMO_CONFIG, DEMO_MODELS, demo_root, is_checkout, vllm_demo_models
from opd_cache.storage.layout import RUN_JSON

ENGINES = ("hf", "vllm")

# What the demo must show (issue: strict ≤ 10% before, ≥ 80% of the teacher's after, KL down ≥ 5×).
MAX_STRICT_BEFORE = 0.10
MIN_SHARE_OF_TEACHER = 0.80
MIN_KL_REDUCTION = 5.0


def _absolute(path: str | None, root: Path) -> str | None:
    if path is None or "://" in path or Path(path).is_absolute():
        return path
    return str(root / path)


def demo_config(out: Path, seed: int, sets: list[str]) -> Config:
    root = demo_root()
    cfg = load_config(
        root / DEMO_CONFIG,
        overrides={"store.uri": str(out / "store"), "rollout.seed": seed, "train.seed": seed},
        sets=sets,
    )
    cfg.rollout.student = _absolute(cfg.rollout.student, root)
    cfg.rollout.prompts = _absolute(cfg.rollout.prompts, root)
    cfg.annotate.teacher = _absolute(cfg.annotate.teacher, root)
    cfg.eval.prompts = _absolute(cfg.eval.prompts, root)
    cfg.eval.teacher = cfg.annotate.teacher
    return cfg


def ensure_demo_models(console: Console) -> None:
    """The demo models are shipped in data/models; in a checkout without them, train them (minutes) once."""
    root = demo_root()
    missing = [name for name in DEMO_MODELS if not (root / name / "model.safetensors").exists()]
    if not missing:
        return
    if not is_checkout(root):
        raise ValueError(
            f"the installed package lacks the demo models ({', '.join(str(root / m) for m in missing)}); "
            f"reinstall opd-cache (pip install --force-reinstall opd-cache)"
        )
    console.print("[yellow]data/models is missing: training the demo models once (a few minutes)…[/]")
    import runpy

    runpy.run_path(str(root / "data" / "make_demo_models.py"), run_name="__main__")


def use_vllm(cfg: Config, models_dir: Path) -> None:
    """Sample and score with vLLM, on copies of the demo models that vLLM's CPU attention accepts."""
    models = vllm_demo_models({"student": cfg.rollout.student, "teacher": cfg.annotate.teacher}, models_dir)
    cfg.rollout.engine = cfg.annotate.engine = "vllm"
    cfg.rollout.student = models["student"]
    cfg.annotate.teacher = cfg.eval.teacher = models["teacher"]
    # GiB of KV cache per engine: the tiny models need little, and vLLM's CPU default takes a share of memory
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


# Every module the demo and its stage processes import, and the package that provides it when it is missing
# (the plots come last, after minutes of training: a missing matplotlib must fail before them).
DEMO_IMPORTS = {
    "torch": "torch==2.13.0",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "pyarrow": "pyarrow",
    "datasets": "datasets",
    "yaml": "pyyaml",
    "pydantic": "pydantic",
    "psutil": "psutil",
    "matplotlib.pyplot": "matplotlib",
    "opd_cache.rollout": None,
    "opd_cache.annotate": None,
    "opd_cache.train.trainer": None,
    "opd_cache.evaluate": None,
    "opd_cache.observe.report": None,
}
# What the demo writes into --out; --overwrite removes exactly these.
DEMO_OUTPUTS = ("store", "logs", "plots", "summary.json", "vllm-models")


def check_demo_imports(engine: str = "hf") -> None:
    """Import what the demo needs now, so that a missing package fails in a second, not after training."""
    import importlib

    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "vllm":
        from opd_cache.vllm_common import import_vllm

        import_vllm()  # one line with the install command when vLLM is missing

    for module in DEMO_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError as e:
            missing = (e.name or module).split(".")[0]
            package = DEMO_IMPORTS.get(missing) or DEMO_IMPORTS.get(module) or missing
            raise ValueError(
                f"the demo needs the Python package {package!r} (module {missing!r} is not installed): "
                f"run `bash scripts/setup.sh`, or `pip install {package}`"
            ) from e


def clear_demo_outputs(out: Path, overwrite: bool) -> None:
    """Refuse to mix two runs in one --out; with `overwrite`, remove the previous demo's outputs first."""
    store = out / "store"
    previous = [out / name for name in DEMO_OUTPUTS if (out / name).exists()]
    store_used = store.is_dir() and any(store.iterdir())
    if not store_used and not (overwrite and previous):
        return
    if not overwrite:
        raise ValueError(
            f"--out {out}: {store} already holds a run; pass --overwrite to replace it, or choose another --out"
        )
    if store_used and not (store / RUN_JSON).exists():
        raise ValueError(
            f"--out {out}: {store} is not an opd store (no run.json); --overwrite leaves it alone: choose another --out"
        )
    for path in previous:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def run_demo(
    out: Path,
    seed: int = 0,
    sets: list[str] | None = None,
    quiet: bool = False,
    overwrite: bool = False,
    engine: str = "hf",
) -> dict:
    out = Path(out)
    # what can fail in seconds fails before the previous run is replaced and before any training
    check_demo_imports(engine)
    cfg = demo_config(out, seed, sets or [])
    clear_demo_outputs(out, overwrite)
    from opd_cache.evaluate import evaluate_model, first_prompts
    from opd_cache.launch.run import supervise, write_resolved_config
    from opd_cache.observe.report import write_report
    from opd_cache.storage.store import Store
    from opd_cache.tasks.prompts import load_prompts
    from opd_cache.tokenizer import load_tokenizer

    console = Console()
    if not console.is_terminal:
        console.width = 120  # a log or a pipe has no width; rich would wrap at 80 columns
    start = time.monotonic()
    ensure_demo_models(console)
    if engine == "vllm":
        use_vllm(cfg, out / "vllm-models")
        console.print(
            f"engine vllm: demo models with attention heads padded to vLLM CPU's size in {out / 'vllm-models'}"
        )

    tokenizer = load_tokenizer(cfg.annotate.teacher)
    held_out = first_prompts(load_prompts(cfg.eval.prompts, tokenizer), cfg.eval.max_prompts)
    teacher = evaluate_model(cfg.annotate.teacher, held_out, tokenizer, max_new_tokens=cfg.eval.max_new_tokens)
    console.print(
        f"teacher on {len(held_out)} held-out prompts: strict {teacher.strict:.3f}, "
        f"lenient {teacher.lenient:.3f}  (e.g. {teacher.example!r})",
        highlight=False,
    )

    config_path = write_resolved_config(cfg, out / "logs" / "config.yaml")
    console.print(f"opd run: store {cfg.store.uri}, logs {out / 'logs'}")
    status = supervise(cfg, config_path, out / "logs", quiet=quiet)
    store = Store(cfg.store.uri)
    report = write_report(store, out / "plots")
    evals = report["eval"]
    if status != 0 or len(evals) < 2:
        raise RuntimeError(f"the demo run failed (status {status}, {len(evals)} evaluations); see {out / 'logs'}")
    before, after = evals[0], evals[-1]
    kl_reduction = before["kl"] / max(after["kl"], 1e-12)
    passed = (
        before["strict"] <= MAX_STRICT_BEFORE
        and after["strict"] >= MIN_SHARE_OF_TEACHER * teacher.strict
        and kl_reduction >= MIN_KL_REDUCTION
    )
    summary = {
        "passed": passed,
        "engine": engine,
        "seconds": round(time.monotonic() - start, 1),
        "teacher": {"strict": teacher.strict, "lenient": teacher.lenient},
        "before": {**before},
        "after": {**after},
        "kl_reduction": kl_reduction,
        "strict_share_of_teacher": after["strict"] / max(teacher.strict, 1e-12),
        "steps": report["steps"],
        "trained_samples": report["trained_samples"],
        "expired_samples": report["expired_samples"],
        "plots": [str(out / "plots" / p) for p in report["plots"]],
        "config": cfg.model_dump(mode="json"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    table = Table(
        title=f"opd demo ({engine}) — {summary['seconds']:.0f} s, {report['steps']} steps, "
        f"{report['trained_samples']} samples"
    )
    for col in ("", "strict (#### N)", "lenient (last number)", "KL(teacher‖student)/token"):
        table.add_column(col, justify="right")
    table.add_row("student before (v0)", f"{before['strict']:.3f}", f"{before['lenient']:.3f}", f"{before['kl']:.4f}")
    table.add_row(
        f"student after (v{after['version']})",
        f"{after['strict']:.3f}",
        f"{after['lenient']:.3f}",
        f"{after['kl']:.4f}",
    )
    table.add_row("teacher", f"{teacher.strict:.3f}", f"{teacher.lenient:.3f}", "0")
    console.print(table)
    verdict = "[green]PASSED[/]" if passed else "[red]FAILED[/]"
    committed_steps = load_config(demo_root() / DEMO_CONFIG).train.max_steps
    shortened = (
        f" (expected with train.max_steps={cfg.train.max_steps}: the bar is set for the committed "
        f"{committed_steps} steps; the student meets it after a few hundred; the store is complete)"
        if not passed and cfg.train.max_steps < committed_steps
        else ""
    )
    console.print(
        f"{verdict}{shortened}: strict {before['strict']:.2f} → {after['strict']:.2f} "
        f"({summary['strict_share_of_teacher']:.0%} of the teacher's), KL down {kl_reduction:.1f}×. "
        f"Summary: {out / 'summary.json'}; plots: {out / 'plots'}",
        soft_wrap=True,  # one line in a log: the paths are not cut at the console's width
    )
    return summary
