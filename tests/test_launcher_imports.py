"""`opd run`'s launcher stays light: it imports neither torch nor transformers (issue #25).

The launcher only starts, watches and stops the stages; each stage imports torch and transformers itself. When
the launcher imported them too (through a two-line helper in rollout/), every `opd run` paid ~3 CPU-s and ~2.4 s of
start-up before its first stage started (benchmarks/bench_stage_cpu.py). A fresh interpreter imports the
modules `opd run` goes through: the CLI, the attach checks, the supervisor.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

LAUNCHER_MODULES = ["opd_cache.cli", "opd_cache.cli.run", "opd_cache.launch.attach", "opd_cache.launch.run"]


def test_the_launcher_imports_neither_torch_nor_transformers():
    probe = (
        "import importlib, sys\n"
        f"for name in {LAUNCHER_MODULES!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
