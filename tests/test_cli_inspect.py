"""`opd --help` lists every stage; `opd inspect` reads a shard written by the store."""

from __future__ import annotations

import json
import subprocess
import sys

from opd_cache.store import Store
from tests.conftest import write_random_rollout_shard


def opd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opd_cache.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_stage():
    out = opd("--help")
    assert out.returncode == 0
    for command in ("rollout", "annotate", "train", "run", "demo", "eval", "inspect", "report"):
        assert command in out.stdout


def test_inspect_json_and_text(tmp_path):
    store = Store(tmp_path / "store")
    table = write_random_rollout_shard(store, shard_id="v000001-w00-000004", num_rows=3, max_response=5, seed=1)
    path = str(store.local_path(store.rollout_path("v000001-w00-000004")))
    out = opd("inspect", path, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["rows"] == 3 and info["metadata"]["policy_version"] == 1
    assert info["response_tokens"] == sum(len(r) for r in table["response_ids"].to_pylist())
    assert info["sample"]["sample_id"] == "v000001-w00-000004-0"
    text = opd("inspect", path, "--sample", "2")
    assert text.returncode == 0 and "sample 2" in text.stdout and "v000001-w00-000004-2" in text.stdout


def test_inspect_bad_shard_is_one_line_error(tmp_path):
    bad = tmp_path / "x.arrow"
    bad.write_bytes(b"not arrow at all")
    out = opd("inspect", str(bad))
    assert out.returncode == 2
    assert "error:" in out.stderr and "x.arrow: truncated or not an Arrow IPC stream" in out.stderr
    assert "Traceback" not in out.stderr
