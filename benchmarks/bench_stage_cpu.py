"""Where `opd run` spends its CPU on bench_trl's workload, stage by stage, against TRL's GKDTrainer (issue #25).

bench_trl.py measures the totals: on 2 cores opd spends more CPU per trained sample than TRL, and with three
stages sharing two cores that CPU sets the wall time. This script splits opd's total:

- **per process**: the launcher and each stage report their own CPU time (user + system, getrusage) when they
  exit, through a `sitecustomize` module this script writes into its output folder and puts on the children's
  PYTHONPATH (a measurement shim: nothing in opd_cache changes);
- **imports**: the CPU a fresh interpreter spends importing what each process imports before its first step
  (the CLI, the stage's module, the model's transformers module), the median of `--rounds` fresh interpreters
  per stage, alternating; for TRL the same for its worker's imports (`datasets`, transformers, TRL's GKD);
- with `--trl-python` (a python with trl installed, see bench_trl.py), one TRL run of the same workload as the
  baseline: its total CPU, and its import CPU measured the same way.

    PYTHONPATH=$PWD python benchmarks/bench_stage_cpu.py --trl-python /tmp/trl/venv/bin/python --out /tmp/stage-cpu

With `--baseline-tree DIR` (another checkout, e.g. `git archive <parent> | tar -x -C DIR`) the same run of that
code goes beside this tree's, and `--repeats N` alternates N rounds of TRL, the baseline and this tree; the tables
are the medians per process, and a last table has each round's totals and ratios.

Prints one table (CPU-s per process, of which imports, ms per trained sample, ratio to TRL's total) and writes
benchmarks/results/bench_stage_cpu.json. One run: the stages' split is what to read; totals move with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import measure, run_pipeline
from bench_trl import run_trl, trl_prompt_rows, trl_spec
from common import write_results

from opd_cache.launch.demo import demo_config, ensure_demo_models
from opd_cache.tokenizer import load_tokenizer

RESULTS = ROOT / "benchmarks" / "results" / "bench_stage_cpu.json"

# what each process imports before its work starts; the model module is imported lazily by from_pretrained
MODEL_MODULE = "transformers.models.llama.modeling_llama"
OPD_IMPORTS = {
    "launcher": ["opd_cache.cli", "opd_cache.launch.attach"],
    "rollout": ["opd_cache.cli", "opd_cache.rollout.worker", MODEL_MODULE],
    "annotate": ["opd_cache.cli", "opd_cache.annotate.worker", MODEL_MODULE],
    "train": ["opd_cache.cli", "opd_cache.train.trainer", MODEL_MODULE],
}
TRL_IMPORTS = ["datasets", "transformers", "trl.experimental.gkd", MODEL_MODULE]

# Written into the output folder and put first on the children's PYTHONPATH: each python process of the run
# appends one JSON line with its own CPU time when it exits normally (the stages do, at the end of a run).
SHIM = """\
import atexit, json, os, resource, sys


def _report_cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {"pid": os.getpid(), "argv": sys.argv[:3], "user_s": usage.ru_utime, "system_s": usage.ru_stime}
    with open(os.environ["OPD_BENCH_CPU_LOG"], "a") as log:
        log.write(json.dumps(record) + "\\n")


if os.environ.get("OPD_BENCH_CPU_LOG"):
    atexit.register(_report_cpu)
"""

IMPORT_PROBE = (
    "import importlib, json, resource, sys\n"
    "for name in sys.argv[1:]: importlib.import_module(name)\n"
    "u = resource.getrusage(resource.RUSAGE_SELF)\n"
    "print(json.dumps({'cpu_s': u.ru_utime + u.ru_stime}))\n"
)


def import_cpu(python: str, modules: list[str]) -> float:
    """CPU-s of a fresh interpreter that imports `modules` (interpreter start-up included) and exits."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([python, "-c", IMPORT_PROBE, *modules], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["cpu_s"]


def process_name(argv: list[str]) -> str:
    """launcher / fork server / rollout / annotate / train from a process's argv (`… cli/__main__.py train …`;
    a stage forked by the fork server has `opd train …`)."""
    if argv and argv[0].endswith("forkserver.py"):
        return "fork server"  # launch/forkserver.py: the stages' imports, once
    stage = argv[1] if len(argv) > 1 else "?"
    return "launcher" if stage == "run" else stage


def run_opd(cfg, out: Path, timeout: float, tree: Path = ROOT) -> dict:
    """`opd run` with the code of `tree` (run from there: `python -m` puts the current folder first)."""
    shim_dir = out / "cpu-shim"
    shim_dir.mkdir(parents=True)
    (shim_dir / "sitecustomize.py").write_text(SHIM)
    cpu_log = out / "process-cpu.jsonl"
    python_path = os.pathsep.join(p for p in (str(shim_dir), str(tree), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": python_path, "OPD_BENCH_CPU_LOG": str(cpu_log)}
    clock = run_pipeline(out.name, out, cfg, timeout=timeout, env=env, cwd=tree)
    if clock["status"] != 0:
        raise SystemExit(f"`opd run` failed (status {clock['status']}): see {out / 'logs'}")
    result = measure(out / "store", clock)
    processes: dict[str, float] = {}
    for line in cpu_log.read_text().splitlines() if cpu_log.exists() else []:
        record = json.loads(line)
        name = process_name(record["argv"])
        processes[name] = processes.get(name, 0.0) + record["user_s"] + record["system_s"]
    keep = ("wall_s", "cpu_s", "load_avg", "time_to_last_step_s", "trained_samples", "expired_samples")
    return {**{k: result[k] for k in keep}, "processes": processes}


def table(opd: dict, imports: dict[str, float], trl: dict | None) -> str:
    samples = opd["trained_samples"]
    trl_cpu = trl["cpu_s"] if trl else None
    rows = [
        "| process | CPU-s | of which imports (fresh interpreter) | the rest | ms per trained sample | share of opd's CPU | ÷ TRL's total CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, cpu: float | None, imported: float | None, base_cpu: float) -> str:
        if cpu is None:
            return f"| {name} | not reported | {imported:.1f} | | | | |"
        rest = "" if imported is None else f"{cpu - imported:.1f}"
        ratio = f"{cpu / trl_cpu:.2f}×" if trl_cpu else ""
        imp = "" if imported is None else f"{imported:.1f}"
        return f"| {name} | {cpu:.1f} | {imp} | {rest} | {1000 * cpu / samples:.2f} | {cpu / base_cpu:.0%} | {ratio} |"

    # forked stages (run.fork_stages) import nothing themselves: the fork server imported for them, once
    forked = "fork server" in opd["processes"]
    for name in ("launcher", "fork server", "rollout", "annotate", "train"):
        if name == "fork server" and not forked:
            continue
        imported = imports.get(name) if not forked or name == "launcher" else None
        rows.append(row(f"opd {name}", opd["processes"].get(name), imported, opd["cpu_s"]))
    reported = sum(opd["processes"].values())
    if forked:  # the launcher's imports, and the fork server's, which are nearly all it does
        opd_imports = imports["launcher"] + opd["processes"]["fork server"]
    else:
        opd_imports = sum(imports[name] for name in OPD_IMPORTS)
    rows.append(row("**opd, all processes** (getrusage of the run)", opd["cpu_s"], opd_imports, opd["cpu_s"]))
    # the gap to the run's getrusage: what each process spends after its exit hook (interpreter shutdown)
    rows.append(f"| (the processes' own reports, at their exit hooks, add up to) | {reported:.1f} | | | | | |")
    if trl:
        rows.append(row("**TRL GKDTrainer, 1 thread** (baseline)", trl["cpu_s"], imports.get("trl"), trl["cpu_s"]))
    return "\n".join(rows)


def median_run(runs: list[dict]) -> dict:
    """The median of each number over the rounds (per process too): one table for several rounds."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    if "processes" in runs[0]:
        names = {n for r in runs for n in r["processes"]}
        out["processes"] = {n: statistics.median(r["processes"].get(n, 0.0) for r in runs) for n in names}
    return out


def rounds_table(sides: dict[str, list[dict]]) -> str:
    """Each round's CPU and time to the last step, with the ratios measured within the round."""
    rows = [
        "| round | TRL CPU-s | baseline CPU-s | this tree CPU-s | ÷ baseline | ÷ TRL | to last step (s): TRL / baseline / this |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for i, run in enumerate(sides["opd"]):
        trl = sides["trl"][i] if i < len(sides["trl"]) else None
        base = sides["baseline"][i] if i < len(sides["baseline"]) else None

        def cell(r: dict | None, key: str = "cpu_s") -> str:
            return f"{r[key]:.1f}" if r else ""

        times = " / ".join(cell(r, "time_to_last_step_s") or "–" for r in (trl, base, run))
        vs_base = f"{run['cpu_s'] / base['cpu_s']:.2f}×" if base else ""
        vs_trl = f"{run['cpu_s'] / trl['cpu_s']:.2f}×" if trl else ""
        rows.append(f"| {i} | {cell(trl)} | {cell(base)} | {cell(run)} | {vs_base} | {vs_trl} | {times} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps × 64 samples (bench_trl's 400)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="fresh interpreters per import measurement")
    parser.add_argument("--trl-python", help="a python with trl installed: run TRL once as the baseline")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="opd config, as `opd run --set`"
    )
    parser.add_argument("--baseline-tree", type=Path, help="another source tree: its `opd run` beside this one's")
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds (TRL, baseline, this tree)")
    parser.add_argument("--out", type=Path, help="folder for the runs (default: a temp folder, removed)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    from rich.console import Console

    ensure_demo_models(Console())
    out = args.out or Path(tempfile.mkdtemp(prefix="opd-bench-stage-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    timeout = 120 + args.steps * 6.0
    torch.set_num_threads(1)

    def config_for(folder: Path):  # each run on a store of its own
        return demo_config(folder, args.seed, [f"train.max_steps={args.steps}", "run.evaluate=false", *args.set])

    cfg = config_for(out / "opd")

    # imports first, alternating the processes round by round so that drift in the load spreads over all
    samples: dict[str, list[float]] = {name: [] for name in [*OPD_IMPORTS, *(["trl"] if args.trl_python else [])]}
    for _ in range(args.rounds):
        for name, modules in OPD_IMPORTS.items():
            samples[name].append(import_cpu(sys.executable, modules))
        if args.trl_python:
            samples["trl"].append(import_cpu(args.trl_python, TRL_IMPORTS))
    imports = {name: statistics.median(values) for name, values in samples.items()}
    print("import CPU-s (median of fresh interpreters):", {k: round(v, 2) for k, v in imports.items()}, flush=True)

    prompts_file = out / "trl-prompts.json"
    if args.trl_python:
        prompts_file.write_text(json.dumps(trl_prompt_rows(cfg, args.steps, load_tokenizer(cfg.rollout.student))))
    sides = {"trl": [], "baseline": [], "opd": []}
    for round_ in range(args.repeats):
        if args.trl_python:
            folder = out / f"trl-{round_}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            spec = trl_spec(cfg, args.steps, folder, prompts_file, threads=1)
            sides["trl"].append(run_trl(folder, spec, args.trl_python, timeout))
        for side, tree in (("baseline", args.baseline_tree), ("opd", ROOT)):
            if tree is None:
                continue
            folder = out / f"{side}-{round_}"
            shutil.rmtree(folder, ignore_errors=True)
            sides[side].append(run_opd(config_for(folder), folder, timeout, tree=tree.resolve()))
        for side, runs in sides.items():
            if len(runs) > round_:
                r = runs[round_]
                print(
                    f"[{side} {round_}] {r['wall_s']:.0f} s, {r['cpu_s']:.1f} CPU-s, load {r['load_avg']:.1f}",
                    flush=True,
                )

    trl = median_run(sides["trl"]) if sides["trl"] else None
    for side, title in (("baseline", f"the baseline tree ({args.baseline_tree})"), ("opd", "this tree")):
        if sides[side]:
            print(
                f"\n## opd's CPU by process, {title} ({args.steps} steps × {cfg.train.global_batch_samples} samples)\n"
            )
            print(table(median_run(sides[side]), imports, trl))
    print("\n## Each round\n")
    print(rounds_table(sides))
    opd = median_run(sides["opd"])
    doc = {
        "steps": args.steps,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "imports_cpu_s": imports,
        "import_samples_cpu_s": samples,
        "opd": opd,
        "trl": None if trl is None else {k: trl[k] for k in ("wall_s", "cpu_s", "load_avg", "time_to_last_step_s")},
        "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
        "rounds": sides,
        "opd_sets": args.set,
    }
    write_results(args.results, doc)
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
