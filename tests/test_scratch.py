"""Temp folders named by their process (opd_cache/storage/scratch.py): what a SIGKILLed process left is removed by
the next process that makes a folder of the same kind; live processes', other kinds', other hosts' and other pid
namespaces' stay."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from opd_cache.models import build_tiny_model
from opd_cache.storage.scratch import owned_temp_prefix
from opd_cache.storage.store import Store
from opd_cache.train.publish import PolicyPublisher

REPO = Path(__file__).resolve().parents[1]
TEMP_FOLDERS = ("mkdtemp", "TemporaryDirectory")

# a trainer's publisher, killed before it could remove its template folder
KILLED_PUBLISHER = """
import os, signal, sys
from opd_cache.models import build_tiny_model
from opd_cache.storage.store import Store
from opd_cache.tokenizer import load_tokenizer
from opd_cache.train.publish import PolicyPublisher

tokenizer = load_tokenizer(sys.argv[1])
publisher = PolicyPublisher(Store(sys.argv[2]), build_tiny_model(vocab_size=len(tokenizer)), tokenizer)
print(publisher.template, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def run_killed(script: str, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=120)


def test_a_killed_trainers_template_folder_is_removed_by_the_next_publisher(
    tmp_path, tokenizer, tokenizer_path, monkeypatch
):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    killed = run_killed(KILLED_PUBLISHER, str(tokenizer_path), str(tmp_path / "store"), tmp=tmp)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = Path(killed.stdout.strip())
    assert left.parent == tmp and (left / "config.json").exists()  # what a kill -9 leaves behind

    publisher = PolicyPublisher(Store(tmp_path / "store"), build_tiny_model(vocab_size=len(tokenizer)), tokenizer)
    assert not left.exists()
    assert [p.name for p in tmp.iterdir()] == [publisher.template.name]
    publisher.close()
    assert list(tmp.iterdir()) == []


def test_only_dead_processes_folders_of_the_same_kind_and_host_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)  # exited and reaped: no such process any more

    prefix = owned_temp_prefix("opd-kind-")
    assert prefix.endswith(f"-pid{os.getpid()}-")
    ours = Path(tempfile.mkdtemp(prefix=prefix))
    dead = tmp_path / re.sub(r"pid\d+-$", f"pid{dead_pid}-abc", prefix)
    live_parent = tmp_path / re.sub(r"pid\d+-$", f"pid{os.getppid()}-abc", prefix)
    other_kind = tmp_path / re.sub(r"^opd-kind-", "opd-other-", dead.name)
    other_host = tmp_path / f"opd-kind-someotherhost-ns1-pid{dead_pid}-abc"
    other_namespace = tmp_path / re.sub(r"-ns\d+-", "-ns1-", dead.name)  # a container of this host name
    assert other_namespace.name != dead.name
    for folder in (dead, live_parent, other_kind, other_host, other_namespace):
        (folder / "sub").mkdir(parents=True)

    assert owned_temp_prefix("opd-kind-") == prefix
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (ours, live_parent, other_kind, other_host, other_namespace)
    )


def test_every_temp_folder_of_the_package_is_named_by_its_process():
    """A new mkdtemp/TemporaryDirectory in opd_cache must use owned_temp_prefix, or a kill -9 leaks it for good."""
    calls = []
    for path in (REPO / "opd_cache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr in TEMP_FOLDERS and ast.unparse(func.value) == "tempfile":
                prefix = next((k.value for k in node.keywords if k.arg == "prefix"), None)
                owned = isinstance(prefix, ast.Call) and ast.unparse(prefix.func) == "owned_temp_prefix"
                calls.append((path.relative_to(REPO).as_posix(), node.lineno, owned))
    assert len(calls) >= 8  # the downloads, publications, resume states and evaluations of today
    assert [c for c in calls if not c[2]] == []
