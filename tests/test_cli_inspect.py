"""`opd --help` lists every stage; `opd inspect` reads a shard written by the store."""

from __future__ import annotations

import json
import subprocess
import sys

from opd_cache.storage import layout
from opd_cache.storage.store import Store
from opd_cache.testing import write_annotated_part
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
    path = str(store.local_path(layout.rollout_path("v000001-w00-000004")))
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

    from opd_cache.storage.schema import annotated_table, list_lengths

    store = Store(tmp_path / "store")
    shard = "v000000-w00-000000"
    table = write_random_rollout_shard(store, shard_id=shard, num_rows=2, max_response=4, seed=5)
    lengths = list_lengths(table["response_ids"])
    total = int(lengths.sum())
    teacher_lp = np.full(total, -7.25, dtype=np.float32)  # far below the student's behavior log-probs (> -1)
    part = annotated_table(
        sample_ids=table["sample_id"].to_pylist(),
        lengths=lengths,
        topk_ids=np.tile(np.arange(4), (total, 1)),
        topk_logprobs=np.full((total, 4), -1.5),
        token_logprob=teacher_lp,
    )
    write_annotated_part(store, store.manifest.read(), shard, "teacher", part, top_k=4)
    row = int(np.argmax(lengths))
    out = opd("inspect", str(store.local_path(layout.rollout_path(shard))), "--sample", str(row))
    assert out.returncode == 0, out.stderr
    assert "per-token view, teacher 'teacher'" in out.stdout
    student_lp = table["behavior_logprobs"][row].as_py()[0]
    assert f"{-7.25 - student_lp:+.3f}" in out.stdout  # the gap of the first token
    bad = opd("inspect", str(store.local_path(layout.rollout_path(shard))), "--teacher", "nobody")
    assert bad.returncode == 2 and "--teacher nobody: shard v000000-w00-000000 has parts from ['teacher']" in bad.stderr


def _rollout_and_part(store: Store, shard: str, run: dict):
    """A rollout shard and the teacher part that scores it (random ids inside the shipped tokenizer)."""
    import numpy as np

    from opd_cache.storage.schema import annotated_table, list_lengths

    table = write_random_rollout_shard(store, shard_id=shard, num_rows=3, max_response=6, seed=3, run=run)
    lengths = list_lengths(table["response_ids"])
    total = int(lengths.sum())
    rng = np.random.default_rng(0)
    part = annotated_table(
        sample_ids=table["sample_id"].to_pylist(),
        lengths=lengths,
        topk_ids=rng.integers(1, 32, size=(total, 4)),
        topk_logprobs=np.full((total, 4), -1.5),
        token_logprob=np.full(total, -2.0, dtype=np.float32),
    )
    write_annotated_part(store, run, shard, "teacher", part, top_k=4)
    return table, part


def test_inspect_annotated_part_decodes_text_with_the_runs_tokenizer(tmp_path, tokenizer, tokenizer_path):
    import numpy as np

    store = Store(tmp_path / "store")
    run = store.manifest.ensure(student=str(tokenizer_path), tokenizer_fingerprint="fp-test")  # the tokenizer's folder
    shard = "v000000-w00-000000"
    table, part = _rollout_and_part(store, shard, run)
    row = int(np.argmax([len(r) for r in table["response_ids"].to_pylist()]))
    response = tokenizer.decode(table["response_ids"][row].as_py(), skip_special_tokens=False)
    prompt = tokenizer.decode(table["prompt_ids"][row].as_py(), skip_special_tokens=False)
    part_path = str(store.local_path(layout.annotated_path(shard, "teacher")))

    out = opd("inspect", part_path, "--sample", str(row))
    assert out.returncode == 0, out.stderr
    assert f"prompt:   {prompt!r}" in out.stdout and f"response: {response!r}" in out.stdout
    assert "per-token view, teacher 'teacher'" in out.stdout
    first_alternative = tokenizer.decode([part["teacher_topk_ids"][row].as_py()[0][0]])
    assert f"{first_alternative!r} 0.22" in out.stdout  # exp(-1.5): the teacher's top ids decoded too

    # without its rollout shard, the part's own ids are decoded: the teacher's first choice at each position
    store.delete(layout.rollout_path(shard))
    out = opd("inspect", part_path, "--sample", str(row))
    assert out.returncode == 0, out.stderr
    top1 = [ids[0] for ids in part["teacher_topk_ids"][row].as_py()]
    assert f"teacher's top-1 token per position: {tokenizer.decode(top1, skip_special_tokens=False)!r}" in out.stdout


def test_inspect_prints_every_metadata_key_of_the_shard(tmp_path):
    from dataclasses import dataclass

    from opd_cache.storage.schema import ROLLOUT, ShardMeta, read_shard, write_shard

    @dataclass
    class MetaFromAFutureStage(ShardMeta):  # a key this version of inspect has never heard of
        def to_metadata(self):
            return {**super().to_metadata(), b"opd.some_new_key": b"its value"}

    store = Store(tmp_path / "store")
    run = store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    write_random_rollout_shard(store, shard_id="v000000-w00-000000", num_rows=2, run=run)
    table, _ = read_shard(store, layout.rollout_path("v000000-w00-000000"))
    rel = layout.rollout_path("v000000-w00-000001")
    write_shard(
        store,
        rel,
        table,
        MetaFromAFutureStage(
            kind=ROLLOUT,
            run_id=run["run_id"],
            tokenizer_fingerprint="fp-test",
            shard_id="v000000-w00-000001",
            policy_version=0,
        ),
    )
    out = opd("inspect", str(store.local_path(rel)))
    assert out.returncode == 0, out.stderr
    stored = {k.decode(): v.decode() for k, v in read_shard(store, rel)[0].schema.metadata.items()}
    assert "opd.some_new_key" in stored
    for key, value in stored.items():
        assert any(line.split() == [key, *value.split()] for line in out.stdout.splitlines()), (key, out.stdout)
    info = json.loads(opd("inspect", str(store.local_path(rel)), "--json").stdout)
    assert info["schema_metadata"] == stored


def test_inspect_of_a_directory_says_so(tmp_path):
    store = Store(tmp_path / "store")
    run = store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    _rollout_and_part(store, "v000000-w00-000000", run)
    folder = store.local_path(layout.annotated_path("v000000-w00-000000", "teacher")).parent
    out = opd("inspect", str(folder))
    assert out.returncode == 2
    assert (
        f"error: {folder} is a folder but not a store (no run.json): opd inspect takes a store (a folder with "
        f"run.json) or a shard (an .arrow file); it holds teacher.arrow: inspect one of them"
        in " ".join(out.stderr.split())
    )
    out = opd("inspect", str(tmp_path))
    assert out.returncode == 2 and f"{tmp_path} is a folder but not a store" in " ".join(out.stderr.split())
    assert "Traceback" not in out.stderr
    out = opd("inspect", str(tmp_path / "nope"))
    assert out.returncode == 2 and f"{tmp_path / 'nope'} does not exist: opd inspect takes a store or a shard" in (
        " ".join(out.stderr.split())
    )


def test_version_ranges_stay_one_short_line_for_a_long_run():
    from opd_cache.cli.inspect import _ranges

    assert _ranges([0, 1, 2, 5]) == "0-2, 5"
    every_other = list(range(0, 800, 2))  # a long run's annotations skip versions
    assert _ranges(every_other) == "0, 2, 4, 6, …, 792, 794, 796, 798 (400 versions in 400 ranges)"


def test_inspect_prints_markup_in_user_data_as_it_is(tmp_path, tokenizer, tokenizer_path):
    """Decoded text, ids and paths are the user's data: "[/bold]" in a response is printed, not taken for Rich
    markup (which dropped it, or stopped inspect with a MarkupError on a closing tag)."""
    import numpy as np

    from opd_cache.storage.schema import annotated_table, list_lengths, rollout_table
    from opd_cache.testing import write_rollout_shard

    store = Store(tmp_path / "st[red]ore")
    run = store.manifest.ensure(student=str(tokenizer_path), tokenizer_fingerprint="fp-test")
    shard = "v000000-w00-000000"
    text = " 12 [/bold] [red]34"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # the shipped tokenizer writes it back as it was
    table = rollout_table(
        sample_ids=[f"{shard}-0"],
        prompt_index=np.arange(1),
        sample_index=np.zeros(1),
        prompt_ids=[np.array(tokenizer.encode("[b]1+1=", add_special_tokens=False))],
        response_ids=[np.array(ids)],
        behavior_logprobs=[np.full(len(ids), -0.5)],
        policy_version=0,
        finish_reason=["stop"],
    )
    write_rollout_shard(store, run, shard, table)
    lengths = list_lengths(table["response_ids"])
    part = annotated_table(
        sample_ids=table["sample_id"].to_pylist(),
        lengths=lengths,
        topk_ids=np.tile(np.array(ids[:4]), (len(ids), 1)),
        topk_logprobs=np.full((len(ids), 4), -1.5),
        token_logprob=np.full(len(ids), -2.0, dtype=np.float32),
    )
    write_annotated_part(store, run, shard, "teacher", part, top_k=4)
    path = str(store.local_path(layout.rollout_path(shard)))
    out = opd("inspect", path)
    assert out.returncode == 0, out.output
    assert f"response: {text!r}" in out.stdout and "prompt:   '[b]1+1='" in out.stdout
    assert path in out.stdout  # the folder's "[red]" kept
    assert "per-token view, teacher 'teacher'" in out.stdout and "│ '['" in out.stdout  # the token column
    summary = opd("inspect", store.uri)
    assert summary.returncode == 0, summary.output
    assert summary.stdout.startswith(f"{store.uri} (run ")
