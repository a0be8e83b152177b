"""The commands in README.md and docs/*.md run as written, in order, so the docs cannot drift from the code.

Every fenced `bash` block is split into commands (continuation lines joined, comments dropped). A command runs
unless SKIPPED names it with the reason (installs, GPUs, S3, Ray clusters, vLLM, servers, the whole test suite).
Each document runs in its own scratch folder, as a user would from a checkout, with `opd` and `python` on PATH
meaning this checkout's and `data/`, `examples/`, `scripts/` linked in, with one change that keeps it fast:
`data/arithmetic/train.parquet` there holds the first 16 prompts, so `opd rollout … --n 4` makes its one pass
in seconds (it used to wait for a trainer for ever, issue #26). A command must exit 0 within COMMAND_TIMEOUT_S.

The demo (`opd demo --out runs/demo`, 800 steps) is too long for the default suite: its store is the one the
README's stage commands build (`runs/demo/store` links to it), and `test_the_demo_commands_of_the_docs` (slow)
runs the documented demos themselves with `--set train.max_steps=24` added.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO

COMMAND_TIMEOUT_S = 300  # a command that does not end fails the test (the README's rollout once looped for ever)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TINY_PROMPTS = 16

# command (a regex searched in it) -> why the default suite does not run it. Keep it small and honest.
SKIPPED: dict[str, str] = {
    r"^bash scripts/demo\.sh": "installs into the environment, then the 800-step demo: `.ci/run` runs it",
    r"^bash scripts/test\.sh": "the test suite itself",
    r"^bash scripts/stress_tests\.sh": "the test suite itself, under load (the lead's merge check)",
    r"^bash scripts/setup\.sh|pip install|python3? -m venv|^printf .*constraints": "installs packages",
    r"/tmp/opd-venv|\.venv-vllm/": "runs from a separate virtual environment (a wheel install, vLLM)",
    r"--engine vllm|-m vllm": "vLLM (its tier: `-m vllm` in .venv-vllm)",
    r"s3://": "an S3 store (tests/test_s3_pipeline.py covers S3 with moto)",
    r"--launcher ray|^RAY_\S+ ray start": "a Ray cluster (tests/test_ray*.py)",
    r"--follow": "runs until a trainer's train/DONE (what `opd run` starts; tests/test_rollout.py)",
    r"^tensorboard ": "a server that runs until stopped",
    r"report_to=\[wandb\]": "W&B online (`wandb login`)",
    r"bench_trl\.py": "a benchmark in its own TRL venv (docs/benchmarks.md)",
    r"bench_stage_cpu\.py": "a 400-step benchmark with TRL's run as its baseline (docs/benchmarks.md); "
    "tests/test_bench_stage_cpu.py checks its measurement shim",
    r"bench_wakeups\.py": "a 400-step A/B against another source tree, 4 runs (docs/benchmarks.md)",
    r"bench_kl_tail\.py": "evaluates the two students a bench_trl run left in its --out folder (docs/benchmarks.md)",
    r"\bPATH\b|\bFILE\b": "a synopsis with placeholders",
    r"^opd demo|^\S+=\S+ opd demo": "the demo: its store is the stage commands' store here; the slow test runs it",
    r"^ray (start|job)": "starts or joins a Ray cluster (on a shared machine it would outlive the test)",
    r"^export AWS_": "S3 credentials",
    r"^bash scripts/gpu_(check|wheels)\.sh": "the GPU check: an NVIDIA GPU, wheels from PyPI (.ci/run: its --dry-run)",
    r"-m pytest": "the test suite itself (the docs name the tests of a feature)",
    r" \[--": "a synopsis (optional flags in brackets)",
    r"/tmp/flow2/": "issue #25's A/B: four demos and two 60-step runs in two checkouts (docs/benchmarks.md)",
    r"examples/arithmetic_agent_cpu": "the multi-turn example's opd run: tests/test_agent_rollout.py runs it (slow)",
    r"while True: pass|^kill \$burner": "a CPU burner beside the agent example's run, and its end (docs/agents.md: the "
    "example measured under load)",
    r"runs/xtok-bar/": "the cross-tokenizer example's 800-step run and its measure: tests/test_cross_tokenizer_pipeline.py "
    "runs and measures it (slow; it made this test ~4 minutes of the default suite)",
}
# What runs: opd itself and `python -c`. Any other command must be in SKIPPED, so nothing unexpected (a server,
# a cluster, an install) ever starts from a doc.
RUNNABLE = r"^(opd|python) "


@dataclass
class Command:
    doc: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}: {self.text}"


def fenced_commands(doc: Path) -> list[Command]:
    """The commands of every ```bash block of `doc`, in order (continuations joined, comments dropped)."""
    text = doc.read_text()
    commands = []
    for block in re.finditer(r"^```(?:bash|sh|shell)\n(.*?)^```", text, re.S | re.M):
        first_line = text[: block.start()].count("\n") + 2
        pending, start = "", None
        for offset, line in enumerate(block.group(1).splitlines()):
            if start is None:
                start = first_line + offset
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            command = strip_comment(pending)
            if command:
                commands.append(Command(doc, start, command))
            pending, start = "", None
    return commands


def strip_comment(line: str) -> str:
    """The line without its trailing `# comment` (a # inside quotes stays)."""
    quote, out = None, []
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        out.append(ch)
    return " ".join("".join(out).split())


def skip_reason(command: str) -> str | None:
    for pattern, reason in SKIPPED.items():
        if re.search(pattern, command):
            return reason
    if not re.match(RUNNABLE, command):
        raise AssertionError(f"{command!r}: neither opd nor python -c; add it to SKIPPED with the reason")
    return None


def any_skip(command: str) -> bool:
    return any(re.search(pattern, command) for pattern in SKIPPED)


def scratch_checkout(folder: Path) -> dict[str, str]:
    """`folder` as a user's checkout (data/, examples/, scripts/ linked; a 16-prompt train.parquet), and the
    environment in which `opd` and `python` are this checkout's."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "scripts"):
        (folder / name).symlink_to(REPO / name)
    data = folder / "data"
    data.mkdir()
    for entry in (REPO / "data").iterdir():
        if entry.name != "arithmetic":
            (data / entry.name).symlink_to(entry)
    (data / "arithmetic").mkdir()
    for entry in (REPO / "data" / "arithmetic").iterdir():
        if entry.name == "train.parquet":
            pq.write_table(pq.read_table(entry).slice(0, TINY_PROMPTS), data / "arithmetic" / entry.name)
        else:
            (data / "arithmetic" / entry.name).symlink_to(entry)
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    for name, target in (("opd", f'"{sys.executable}" -m opd_cache.cli'), ("python", f'"{sys.executable}"')):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        shim.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",  # tiny models on shared cores
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }


def run(command: Command, cwd: Path, env: dict[str, str], expect: int = 0) -> subprocess.CompletedProcess:
    start = time.monotonic()
    try:
        out = subprocess.run(
            ["bash", "-c", command.text], cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{command}\ndid not finish in {COMMAND_TIMEOUT_S} s; its output ended:\n{str(e.stdout)[-2000:]}")
    assert out.returncode == expect, (
        f"{command}\nexit {out.returncode} after {time.monotonic() - start:.0f} s\n"
        f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    )
    return out


def provide_demo_store(cwd: Path, store: Path) -> None:
    """What `opd demo --out runs/demo` leaves for the commands after it: here, the stage commands' store."""
    (cwd / "runs" / "demo").mkdir(parents=True, exist_ok=True)
    if not (cwd / "runs" / "demo" / "store").exists():
        (cwd / "runs" / "demo" / "store").symlink_to(store)


def run_doc(doc: Path, cwd: Path, env: dict[str, str], store: Path | None) -> list[str]:
    """Run `doc`'s commands in order; the ones run, for the test's own checks."""
    ran = []
    for command in fenced_commands(doc):
        if re.search(r"^opd demo --out runs/demo(\s|$)", command.text) and store is not None:
            provide_demo_store(cwd, store)
            continue
        if skip_reason(command.text):
            continue
        run(command, cwd, env)
        ran.append(command.text)
    return ran


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's commands, in order, in a scratch checkout; its stage commands' store serves the docs."""
    cwd = tmp_path_factory.mktemp("readme")
    env = scratch_checkout(cwd)
    ran = run_doc(REPO / "README.md", cwd, env, store=cwd / "runs" / "s")
    return cwd, ran


def test_every_fenced_command_is_run_or_skipped_with_a_reason():
    commands = [c for doc in DOCS for c in fenced_commands(doc)]
    assert len(commands) >= 30, [str(c) for c in commands]
    used = {pattern for c in commands for pattern in SKIPPED if re.search(pattern, c.text)}
    assert used == set(SKIPPED), f"SKIPPED entries that match no command any more: {set(SKIPPED) - used}"
    unclassified = [str(c) for c in commands if not re.match(RUNNABLE, c.text) and not any_skip(c.text)]
    assert not unclassified, f"add these to SKIPPED with a reason: {unclassified}"
    ran = [c for c in commands if not skip_reason(c.text)]
    assert len(ran) >= 10, [str(c) for c in ran]
    # the extraction: continuations joined, comments dropped, a '#' inside quotes kept
    rollout = next(c for c in commands if c.doc.name == "rollout.md" and "--max-samples" in c.text)
    assert rollout.text.startswith("opd rollout runs/demo --student") and "parquet --n 4 --max-new" in rollout.text
    assert rollout.text.endswith("--worker-id w00")  # the continuation line, joined
    assert strip_comment("opd export a --to b   # --format arrow") == "opd export a --to b"
    assert strip_comment("python -c \"print('#1')\"  # x") == "python -c \"print('#1')\""


def test_the_readmes_commands_run_in_order(readme_run):
    cwd, ran = readme_run
    stages = [c for c in ran if re.match(r"opd (rollout|annotate|train|inspect) ", c)]
    assert [c.split()[1] for c in stages[:4]] == ["rollout", "annotate", "train", "inspect"], ran
    assert "--max-samples" not in stages[0] and "--follow" not in stages[0]  # the one pass, as documented
    assert (cwd / "runs" / "s" / "train" / "progress.json").exists()
    assert (cwd / "runs" / "demo-export" / "teacher.parquet").exists()  # the Reuse section, on that store


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "README.md"], ids=lambda d: d.name)
def test_the_commands_of_each_doc_run_in_order(doc, readme_run, tmp_path):
    store = readme_run[0] / "runs" / "s"
    env = scratch_checkout(tmp_path / "checkout")
    provide_demo_store(tmp_path / "checkout", store)  # the docs take a demo run for granted (the README's first)
    run_doc(doc, tmp_path / "checkout", env, store=store)


@pytest.mark.slow
def test_the_demo_commands_of_the_docs(tmp_path):
    """The documented demos (each distinct one once), shortened to 24 steps: too few to pass the demo's bar, which
    the demo says as it fails. Demos that differ only in their --out folder are one demo (five commands, two
    demos: ~40 s each on CI's 2 cores)."""
    env = scratch_checkout(tmp_path)
    demos: dict[str, Command] = {}
    for command in (c for doc in DOCS for c in fenced_commands(doc)):
        if re.match(r"^(\S+=\S+ )?opd demo ", command.text) and "--engine vllm" not in command.text:
            flags = re.sub(r"\s*--out \S+|\s*--set train\.max_steps=24", "", command.text)
            demos.setdefault(flags, command)
    assert len(demos) >= 2, list(demos)
    for flags, command in demos.items():
        short = f"{flags} --out runs/demo --set train.max_steps=24"
        out = run(Command(command.doc, command.line, f"{short} --overwrite"), tmp_path, env, expect=1)
        assert "FAILED" in out.stdout and "expected with train.max_steps=24" in " ".join(out.stdout.split()), out.stdout
