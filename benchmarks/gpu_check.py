"""The GPU check's Python steps; scripts/gpu_check.sh runs each in its own process, under its own time limit.

    python benchmarks/gpu_check.py STEP --record FILE --work DIR [--toy]

STEP is one of
  env        the machine: Python, torch, CUDA, the device, transformers, triton, flash-attn, liger-kernel
  imports    every opd_cache module imports; pyproject's pins against the installed versions (the version gap)
  tests      pytest on a selection (--select cuda | gpu-default), its results as items (--collect-only: the dry run)
  loss       fused vs materialised loss: peak memory and time at V = 151,936 (benchmarks/gpu_loss.py)
  engines    rollout / annotate parity in bf16, attention, publish + reload (benchmarks/gpu_engines.py)
  train      trainer tokens/s and MFU on one GPU (benchmarks/gpu_train.py)
  train-fsdp the same under torchrun --nproc_per_node 1: NCCL, FSDP2 (run by torchrun, see gpu_check.sh)
Each records its checks and figures in FILE (gpu_report.StepRecord) as it goes and exits 1 when one failed.
`--toy`: the dry run's sizes, on the CPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import pkgutil
import platform
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

from gpu_report import StepRecord

# Tests the check runs. cuda: every test marked `cuda` (pyproject.toml's marker), in the files that use it.
# gpu-default: the default suite's loss, trainer and HF-engine tests as they are: their trainer and engines take
# `device: auto`, so on a GPU machine they train and sample on CUDA (bf16 autocast), while the loss tests build
# CPU tensors (tests/test_cuda.py runs their checks on CUDA). test_train_distributed.py is left out: its
# two-process test puts both ranks on CUDA when there is one, which needs two GPUs.
GPU_DEFAULT_TESTS = [
    "tests/test_losses.py",
    "tests/test_fused_losses.py",
    "tests/test_trainer.py",
    "tests/test_publish.py",
    "tests/test_hf_generate.py",
    "tests/test_hf_score.py",
]
# Modules whose import needs an optional extra the image lacks: their ImportError is a skip, not a failure.
OPTIONAL_IMPORTS = {"vllm", "ray", "s3fs", "boto3", "wandb", "tensorboard", "math_verify", "flash_attn"}


def cuda_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.cuda" in p.read_text())


# ---------------------------------------------------------------- env
def step_env(record: StepRecord, work: Path, toy: bool) -> None:
    import torch

    record.figure("python", platform.python_version(), note=sys.executable)
    record.figure("torch", torch.__version__, note=f"CUDA {torch.version.cuda}")
    cuda = torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(0)
        record.figure("device", torch.cuda.get_device_name(0),
                      note=f"{props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s), "
                      f"bf16 {torch.cuda.is_bf16_supported()}")  # fmt: skip
    elif toy:
        record.item("device", "skipped", "cpu", note="dry run: no CUDA here, toy sizes on the CPU")
    else:
        record.item("device", "failed", None, note="torch.cuda.is_available() is False")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        if smi.returncode == 0:
            record.figure("nvidia-smi", smi.stdout.strip().splitlines()[0])
    except (OSError, subprocess.TimeoutExpired):
        pass
    versions = {}
    for name in ("transformers", "triton", "flash-attn", "liger-kernel", "pydantic", "pyarrow"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            record.item(name, "skipped", None, note="not installed")
            continue
        note = ""
        if name in ("flash-attn", "liger-kernel"):  # optional kernels: installed is not enough, they must import
            try:
                importlib.import_module(name.replace("-", "_"))
            except Exception as e:
                note = f"does not import: {type(e).__name__}: {e}"[:200]
        record.item(name, "skipped" if note else "passed", versions[name], note=note)
    record.figure("cpus", os.cpu_count())
    meta_file = work / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    meta["device"] = torch.cuda.get_device_name(0) if cuda else "CPU (no CUDA)"
    meta["versions"] = (f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
                        f"transformers {versions.get('transformers', 'missing')}")  # fmt: skip
    meta_file.write_text(json.dumps(meta, indent=1))


# ---------------------------------------------------------------- imports
def step_imports(record: StepRecord, work: Path, toy: bool) -> None:
    import gpu_deps

    failed, optional, count = [], [], 0
    import opd_cache

    for module in pkgutil.walk_packages(opd_cache.__path__, "opd_cache."):
        count += 1
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as e:
            (optional if (e.name or "").split(".")[0] in OPTIONAL_IMPORTS else failed).append(
                f"{module.name} ({e.name})"
            )
        except Exception as e:
            failed.append(f"{module.name} ({type(e).__name__}: {e})"[:200])
    record.item("opd_cache modules import", "failed" if failed else "passed", count - len(failed) - len(optional),
                "modules", "; ".join(failed)[:600] or f"from {Path(opd_cache.__file__).parent}")  # fmt: skip
    if optional:
        record.item("modules of optional extras", "skipped", len(optional), "modules", "; ".join(optional)[:400])
    import gpu_api

    stale = gpu_api.check_names()
    record.item("names the check calls (benchmarks/gpu_api.py)", "failed" if stale else "passed",
                len(gpu_api._NAMES) - len(stale), "names", "; ".join(stale) or "all import")  # fmt: skip
    for r in gpu_deps.version_gaps(gpu_deps.runtime_requirements()):
        record.item(f"version {r['name']}", r["status"], r.get("value"), "", r["note"])


# ---------------------------------------------------------------- tests
RESULT_LINE = re.compile(r"^(\S+::\S+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
REASON_LINE = re.compile(r"^(FAILED|ERROR) (\S+?)(?: - (.*))?$")


def step_tests(record: StepRecord, select: str, collect_only: bool, deadline_s: float) -> None:
    files = cuda_test_files() if select == "cuda" else GPU_DEFAULT_TESTS
    run_pytest(record, select, files, ["-m", "cuda"] if select == "cuda" else [], collect_only, deadline_s)


def run_pytest(
    record: StepRecord, label: str, files: list[str], args: list[str], collect_only: bool, deadline_s: float
) -> None:
    """pytest on `files`, streamed to this step's log; a summary item and one item per failed test. Stopped at
    `deadline_s` with what finished recorded (the shell's limit would lose it)."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *files, *args]
    command += ["--collect-only", "-q"] if collect_only else ["-v", "-rfE", "--color=no"]
    print("$", " ".join(command), flush=True)
    # its own process group: at the deadline the tests' own subprocesses (trainers, torchrun) go with it
    # COLUMNS: pytest cuts its short summary (the failure's message) to the terminal's width, 80 without one
    env = {**os.environ, "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}  # and each line as it is written
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    results, reasons, lines = {}, {}, []
    fired = threading.Event()

    def stop() -> None:  # at the deadline, even a test that hangs without output
        fired.set()
        os.killpg(proc.pid, signal.SIGKILL)

    # the shell's limit for this step (GPU_CHECK_LIMIT_S) may be shorter than asked when the budget runs low
    limit = float(os.environ.get("GPU_CHECK_LIMIT_S", "inf"))
    deadline_s = min(deadline_s, limit - 10)
    watchdog = threading.Timer(deadline_s, stop)
    watchdog.start()
    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))  # `timeout` stops this step anyway
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
        if match := RESULT_LINE.match(line):
            results[match.group(1)] = match.group(2)
        elif match := REASON_LINE.match(line.strip()):
            reasons[match.group(2)] = match.group(3) or ""
    watchdog.cancel()
    timed_out = fired.is_set()
    rc = proc.wait()
    if collect_only:
        collected = [line for line in lines if "::" in line]
        ok = rc == 0 and collected
        record.item(f"pytest --collect-only ({label})", "passed" if ok else "failed", len(collected), "tests",
                    f"{len(files)} file(s): {' '.join(files)}" if ok else f"exit {rc}: {lines[-1] if lines else ''}")  # fmt: skip
        return
    counts = {s: sum(v == s for v in results.values()) for s in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    summary = ", ".join(f"{n} {s.lower()}" for s, n in counts.items() if n)
    if timed_out:
        record.item(
            f"pytest ({label})", "failed", len(results), "tests", f"stopped after {deadline_s:.0f} s: {summary}"
        )
    elif rc not in (0, 1, 5):
        record.item(f"pytest ({label})", "failed", len(results), "tests", f"exit {rc}: {(lines or [''])[-1]}")
    elif not results:
        record.item(f"pytest ({label})", "skipped", 0, "tests", "no test ran")
    else:
        status = "failed" if counts["FAILED"] or counts["ERROR"] else "passed"
        if counts["PASSED"] == 0 and status == "passed":
            status = "skipped"
        record.item(f"pytest ({label})", status, len(results), "tests", summary)
    for test, outcome in results.items():
        if outcome in ("FAILED", "ERROR"):
            record.item(test, "failed", note=reasons.get(test, outcome)[:300])


# ---------------------------------------------------------------- measurements
def measurement(module: str, entry: str = "run"):
    def step(record: StepRecord, work: Path, toy: bool) -> None:
        from gpu_measure import pick_device

        try:
            device = pick_device(toy)
        except RuntimeError as e:
            record.item(module, "skipped", note=str(e))
            return
        run = getattr(importlib.import_module(module), entry)
        if module == "gpu_loss":
            run(record, device, toy)
        else:
            run(record, device, toy, work)

    return step


STEPS = {
    "env": step_env,
    "imports": step_imports,
    "loss": measurement("gpu_loss"),
    "engines": measurement("gpu_engines"),
    "train": measurement("gpu_train"),
    "train-fsdp": measurement("gpu_train", "run_fsdp"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=[*STEPS, "tests"])
    parser.add_argument("--record", type=Path, required=True, help="the step's record (JSON), written as it goes")
    parser.add_argument("--work", type=Path, required=True, help="the check's scratch folder (models, stores)")
    parser.add_argument("--toy", action="store_true", help="the dry run: tiny sizes on the CPU")
    parser.add_argument("--select", choices=["cuda", "gpu-default"], help="tests: which selection")
    parser.add_argument("--collect-only", action="store_true", help="tests: collect, do not run")
    parser.add_argument("--deadline-s", type=float, default=600.0, help="tests: stop pytest after this long")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    record = StepRecord(args.record)
    try:
        if args.step == "tests":
            step_tests(record, args.select, args.collect_only, args.deadline_s)
        else:
            STEPS[args.step](record, args.work, args.toy)
    except Exception as e:  # recorded, then re-raised for the log's traceback
        record.item(args.step, "failed", note=f"{type(e).__name__}: {e}"[:400])
        raise
    sys.exit(1 if record.failed else 0)


if __name__ == "__main__":
    main()
