"""`opd --help` lists every stage; `opd inspect` reads a shard written by the store."""

from __future__ import annotations

import json
import subprocess
import sys

from opd_cache.store import Store
from tests.conftest import write_random_rollout_shard


def opd(*args: str):
    """Run the real `opd` app in-process (same parsing and error handling as the console script, no start-up)."""
    from typer.testing import CliRunner

    import opd_cache.cli  # noqa: F401  (registers the commands)
    from opd_cache.cli.common import app

    result = CliRunner().invoke(app, list(args))
    result.returncode = result.exit_code
    return result


def test_console_script_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "opd_cache.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "inspect" in out.stdout


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


def test_inspect_per_token_view_shows_teacher_student_gap(tmp_path):
    import numpy as np

    from opd_cache.schema import ANNOTATED, ShardMeta, annotated_table, list_lengths, write_shard

    store = Store(tmp_path / "store")
    shard = "v000000-w00-000000"
    table = write_random_rollout_shard(store, shard_id=shard, num_rows=2, max_response=4, seed=5)
    lengths = list_lengths(table["response_ids"])
    total = int(lengths.sum())
    teacher_lp = np.full(total, -7.25, dtype=np.float32)  # far below the student's behavior log-probs (> -1)
    part = annotated_table(sample_ids=table["sample_id"].to_pylist(), lengths=lengths,
                           topk_ids=np.tile(np.arange(4), (total, 1)), topk_logprobs=np.full((total, 4), -1.5),
                           token_logprob=teacher_lp)
    run = store.read_run()
    write_shard(store, store.annotated_path(shard, "teacher"), part,
                ShardMeta(kind=ANNOTATED, run_id=run["run_id"], tokenizer_fingerprint=run["tokenizer_fingerprint"],
                          shard_id=shard, policy_version=0, top_k=4, teacher="teacher"))
    row = int(np.argmax(lengths))
    out = opd("inspect", str(store.local_path(store.rollout_path(shard))), "--sample", str(row))
    assert out.returncode == 0, out.stderr
    assert "per-token view, teacher 'teacher'" in out.stdout
    student_lp = table["behavior_logprobs"][row].as_py()[0]
    assert f"{-7.25 - student_lp:+.3f}" in out.stdout  # the gap of the first token
    bad = opd("inspect", str(store.local_path(store.rollout_path(shard))), "--teacher", "nobody")
    assert bad.returncode == 2 and "--teacher nobody: shard v000000-w00-000000 has parts from ['teacher']" in bad.stderr
