"""`opd export` and `opd inspect STORE`: the teacher cache read back by datasets, polars and duckdb.

The store is real: random rollout shards scored by `annotate` with two tiny teachers and routing (so one
teacher's part holds a subset of a shard's rows, another's is empty), in two policy-version partitions.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from opd_cache.annotate import run_annotate
from opd_cache.config import AnnotateConfig, Config
from opd_cache.storage import layout
from opd_cache.storage.schema import ANNOTATED, ROLLOUT, read_shard, rollout_table
from opd_cache.storage.store import Store, make_shard_id
from opd_cache.testing import write_annotated_part, write_rollout_shard
from opd_cache.tokenizer import tokenizer_fingerprint
from tests.test_cli_inspect import opd

VOCAB = 99  # the shipped tokenizer
SOURCES = {  # shard -> data_source of each row; routing: math -> tA, everything else -> tB
    make_shard_id(0, "w00", 0): ["math", "code", "math", None, "code", "math"],
    make_shard_id(0, "w00", 1): ["code", "code"],  # tA's part of this shard is empty
    make_shard_id(1, "w00", 0): ["math", "math", "code"],
}


@pytest.fixture(scope="module")
def annotated_store(tmp_path_factory, tiny_model_factory, tokenizer) -> Store:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only slow a shared machine down
    try:
        store = Store(tmp_path_factory.mktemp("export") / "store")
        student = tiny_model_factory("student", seed=0)  # a folder with the tokenizer: what text decodes with
        run = store.manifest.ensure(
            student=str(student), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=len(tokenizer)
        )
        for n, (shard_id, sources) in enumerate(SOURCES.items()):
            write_rollout(store, run, shard_id, sources, seed=n)
        routing = {"math": "tA"}
        teacher_a = AnnotateConfig(
            teacher=str(tiny_model_factory("teacher", seed=1)),
            top_k=4,
            teacher_name="tA",
            routing=routing,
            default_teacher="tB",
        )
        run_annotate(Config(annotate=teacher_a), store)
        teacher_b = AnnotateConfig(teacher=str(tiny_model_factory("teacher", seed=2)), top_k=4, teacher_name="tB")
        run_annotate(Config(annotate=teacher_b), store)
    finally:
        torch.set_num_threads(threads)
    return store


def write_rollout(store: Store, run: dict, shard_id: str, sources: list, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = len(sources)
    lengths = rng.integers(1, 7, size=n)
    version = int(shard_id[1:7])
    table = rollout_table(
        sample_ids=[f"{shard_id}-{i}" for i in range(n)],
        prompt_index=np.arange(n) + 10 * seed,
        sample_index=np.arange(n) % 2,
        prompt_ids=[rng.integers(3, VOCAB, size=4) for _ in range(n)],
        response_ids=[rng.integers(3, VOCAB, size=m) for m in lengths],
        behavior_logprobs=[-rng.random(m) for m in lengths],
        policy_version=version,
        finish_reason=["stop" if i % 2 else "length" for i in range(n)],
        data_source=sources,
        ground_truth=[f"gt{i}" for i in range(n)],
    )
    write_rollout_shard(store, run, shard_id, table)


def store_hashes(store: Store) -> dict[str, str]:
    root = Path(store.root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def packed_copy(source: Store, dst: Path, damage=None) -> Store:
    """`source` copied with every annotated part re-encoded by the packed codec (as `annotate.codec: packed`
    writes it); `damage(table, meta)` may change the first part before it is written, bypassing validation."""
    import dataclasses

    import pyarrow as pa

    from opd_cache.storage import codec, schema

    shutil.copytree(source.root, dst)
    store = Store(dst)
    vocab = store.manifest.require().vocab_size
    first = True
    for shard in store.shards.rollouts():
        for teacher in ("tA", "tB"):
            rel = layout.annotated_path(shard.shard_id, teacher)
            plain, meta = read_shard(store, rel)
            table, codec_meta = codec.encode_annotation(plain, vocab)
            meta = dataclasses.replace(meta, codec="packed", codec_id_bits=int(codec_meta[codec.META_ID_BITS]))
            if damage is not None and first:
                table, meta = damage(table, meta, pa)
                first = False
                validate, schema.validate_table = schema.validate_table, lambda *a, **kw: None
                try:
                    schema.write_shard(store, rel, table, meta)
                finally:
                    schema.validate_table = validate
                continue
            schema.write_shard(store, rel, table, meta)
    return store


def expected_rows(store: Store, teacher: str, tokenizer) -> list[dict]:
    """What the export must hold for `teacher`, built directly from the shards (rollout order, shard order)."""
    rows = []
    run = store.manifest.require()
    for shard in store.shards.rollouts():
        rollout = {r["sample_id"]: r for r in read_shard(store, shard.path, kind=ROLLOUT, run=run)[0].to_pylist()}
        part, meta = read_shard(store, layout.annotated_path(shard.shard_id, teacher), kind=ANNOTATED, run=run)
        for ann in part.to_pylist():
            r = rollout[ann["sample_id"]]
            rows.append(
                {
                    "sample_id": r["sample_id"],
                    "shard_id": shard.shard_id,
                    "policy_version": r["policy_version"],
                    "prompt_index": r["prompt_index"],
                    "sample_index": r["sample_index"],
                    "data_source": r["data_source"],
                    "ground_truth": r["ground_truth"],
                    "finish_reason": r["finish_reason"],
                    "prompt": tokenizer.decode(r["prompt_ids"], skip_special_tokens=False),
                    "response": tokenizer.decode(r["response_ids"], skip_special_tokens=False),
                    "prompt_ids": r["prompt_ids"],
                    "response_ids": r["response_ids"],
                    "behavior_logprobs": r["behavior_logprobs"],
                    "loss_mask": r.get("loss_mask"),  # single-turn rows: null
                    "teacher_token_logprob": ann["teacher_token_logprob"],
                    "teacher_topk_ids": ann["teacher_topk_ids"],
                    "teacher_topk_logprobs": ann["teacher_topk_logprobs"],
                }
            )
    return rows


def test_parquet_export_equals_the_shards_in_datasets_polars_and_duckdb(annotated_store, tmp_path, tokenizer):
    import datasets

    before = store_hashes(annotated_store)
    out = opd("export", annotated_store.uri, "--to", str(tmp_path / "out"))
    assert out.returncode == 0, out.output
    assert store_hashes(annotated_store) == before  # the store is only read
    assert "export: 3/3 shards" in out.stderr  # not a terminal: plain progress lines
    manifest = json.loads((tmp_path / "out" / "export.json").read_text())
    assert manifest["run_id"] == annotated_store.manifest.require()["run_id"]

    for teacher in ("tA", "tB"):
        expected = expected_rows(annotated_store, teacher, tokenizer)
        assert len(expected) == {"tA": 5, "tB": 6}[teacher]  # routing: math rows to tA, the rest to tB
        path = str(tmp_path / "out" / f"{teacher}.parquet")
        got = datasets.load_dataset("parquet", data_files=path, split="train")
        assert got.to_list() == expected
        tokens = sum(len(r["response_ids"]) for r in expected)
        assert manifest["teachers"][teacher] == {
            "file": f"{teacher}.parquet",
            "rows": len(expected),
            "tokens": tokens,
            "top_k": 4,
            "topk_logprob_dtype": "float32",
            "shards_without_part": 0,
        }
        assert f"{teacher}.parquet: {len(expected)} rows, {tokens} response tokens, top-4" in out.stdout

        polars = pytest.importorskip("polars")
        assert polars.read_parquet(path).to_dicts() == expected
        duckdb = pytest.importorskip("duckdb")
        con = duckdb.connect()
        n, first_top = con.execute(f"select count(*), sum(teacher_topk_ids[1][1]) from '{path}'").fetchone()
        assert n == len(expected)
        assert first_top == sum(r["teacher_topk_ids"][0][0] for r in expected)


def test_a_packed_store_exports_its_decoded_annotations(annotated_store, tmp_path, tokenizer):
    """`annotate.codec: packed` parts export as float32 columns, the values every reader decodes."""
    import datasets

    packed = packed_copy(annotated_store, tmp_path / "packed")
    out = opd("export", packed.uri, "--to", str(tmp_path / "out"))
    assert out.returncode == 0, out.output
    for teacher in ("tA", "tB"):
        expected = expected_rows(packed, teacher, tokenizer)
        plain = expected_rows(annotated_store, teacher, tokenizer)
        assert [r["teacher_topk_logprobs"] for r in expected] != [r["teacher_topk_logprobs"] for r in plain]  # coded
        got = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / f"{teacher}.parquet"), split="train")
        assert got.to_list() == expected
    out = opd("inspect", packed.uri)
    assert out.returncode == 0 and "codec packed v3" in out.stdout


def test_arrow_export_loads_like_the_parquet_one(annotated_store, tmp_path, tokenizer):
    import datasets

    out = opd("export", annotated_store.uri, "--to", str(tmp_path / "out"), "--format", "arrow", "--teacher", "tA")
    assert out.returncode == 0, out.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["export.json", "tA.arrow"]
    path = str(tmp_path / "out" / "tA.arrow")
    expected = expected_rows(annotated_store, "tA", tokenizer)
    assert datasets.load_dataset("arrow", data_files=path, split="train").to_list() == expected
    polars = pytest.importorskip("polars")
    assert polars.read_ipc_stream(path).to_dicts() == expected


def test_export_refusals_are_one_line_and_write_nothing(annotated_store, tmp_path, tokenizer_path):
    # a store with rollouts but no annotations
    bare = Store(tmp_path / "bare")
    run = bare.manifest.ensure(student=str(tokenizer_path), tokenizer_fingerprint="fp")
    write_rollout(bare, run, make_shard_id(0, "w00", 0), ["math"], seed=0)
    out = opd("export", bare.uri, "--to", str(tmp_path / "a"))
    assert out.returncode == 2
    assert (
        f"{bare.path('')} has no annotated parts (1 rollout shards, none annotated): run `opd annotate` on it first"
        in " ".join(out.stderr.split())
    )
    assert not (tmp_path / "a").exists()

    # a non-empty --to without --overwrite; --overwrite never deletes what is not an export
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    out = opd("export", annotated_store.uri, "--to", str(busy))
    assert out.returncode == 2
    assert f"--to {busy} is not empty (1 entries): choose a new folder or pass --overwrite" in " ".join(
        out.stderr.split()
    )
    out = opd("export", annotated_store.uri, "--to", str(busy), "--overwrite")
    assert (
        out.returncode == 2
        and "holds no export.json: --overwrite only replaces an earlier `opd export`" in " ".join(out.stderr.split())
    )
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]

    # an earlier export is replaced with --overwrite
    again = tmp_path / "again"
    assert opd("export", annotated_store.uri, "--to", str(again), "--format", "arrow").returncode == 0
    out = opd("export", annotated_store.uri, "--to", str(again), "--overwrite")
    assert out.returncode == 0, out.output
    assert sorted(p.name for p in again.iterdir()) == ["export.json", "tA.parquet", "tB.parquet"]

    # a student that is a hub id: text is never fetched from a hub
    hub = Store(tmp_path / "hub")
    run = hub.manifest.ensure(student="HuggingFaceTB/SmolLM2-135M", tokenizer_fingerprint="fp")
    (tmp_path / "hub" / "run.json").write_text(
        json.dumps({**annotated_store.manifest.require(), "student": "HuggingFaceTB/SmolLM2-135M"})
    )
    for shard in annotated_store.shards.rollouts():
        for rel in [shard.path] + [layout.annotated_path(shard.shard_id, t) for t in ("tA", "tB")]:
            hub.write_bytes(rel, annotated_store.read_bytes(rel))
    out = opd("export", hub.uri, "--to", str(tmp_path / "b"))
    assert out.returncode == 2
    assert (
        "names the student 'HuggingFaceTB/SmolLM2-135M', which is not a local folder; pass --tokenizer DIR"
        in " ".join(out.stderr.split())
    )
    assert not (tmp_path / "b").exists()
    out = opd("export", hub.uri, "--to", str(tmp_path / "b"), "--tokenizer", str(tokenizer_path))
    assert out.returncode == 0, out.output
    out = opd("export", hub.uri, "--to", str(tmp_path / "c"), "--no-text")
    assert out.returncode == 0, out.output
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "c" / "tB.parquet")
    assert table["prompt"].null_count == table.num_rows == 6
    assert table["response_ids"].to_pylist() == pq.read_table(tmp_path / "b" / "tB.parquet")["response_ids"].to_pylist()


def test_inspect_store_summarizes_the_cache(annotated_store, tmp_path, tokenizer_path):
    run = annotated_store.manifest.require()
    before = store_hashes(annotated_store)
    info = json.loads(opd("inspect", annotated_store.uri, "--json").stdout)
    assert store_hashes(annotated_store) == before
    rollouts = [read_shard(annotated_store, s.path)[0] for s in annotated_store.shards.rollouts()]
    assert info["run_id"] == run["run_id"] and info["policy_versions"] == [0, 1]
    assert info["rollouts"] == {
        "shards": 3,
        "rows": 11,
        "bytes": sum(s.size for s in annotated_store.shards.rollouts()),
        "response_tokens": sum(len(r) for t in rollouts for r in t["response_ids"].to_pylist()),
    }
    lines = opd("inspect", annotated_store.uri).stdout.splitlines()
    for teacher in ("tA", "tB"):
        rels = [layout.annotated_path(s.shard_id, teacher) for s in annotated_store.shards.rollouts()]
        parts = [read_shard(annotated_store, rel)[0] for rel in rels]
        size = sum((Path(annotated_store.root) / rel).stat().st_size for rel in rels)
        tokens = sum(len(r) for p in parts for r in p["teacher_token_logprob"].to_pylist())
        t = info["teachers"][teacher]
        assert (t["parts"], t["rows"], t["tokens"], t["bytes"]) == (3, {"tA": 5, "tB": 6}[teacher], tokens, size)
        assert t["top_k"] == [4] and t["topk_logprob_dtype"] == ["float32"] and t["policy_versions"] == [0, 1]
        assert t["codec"] == ["none"]
        assert t["engine"] == [
            " ".join(
                parts[0].schema.metadata[k].decode() for k in (b"opd.engine", b"opd.engine_version", b"opd.model_dtype")
            )
        ]
        assert t["bytes_per_token"] == pytest.approx(size / tokens)
        line = next(line for line in lines if line.strip().startswith(f"teacher {teacher}:"))
        assert (
            f"k=4, 3 parts, {t['rows']} rows, {tokens} tokens, {size} bytes ({size / tokens:.1f} bytes/token stored"
            in line
            and "codec none, top-k log-probs float32, versions 0-1, engine hf " in line
        )

    bare = Store(tmp_path / "bare")
    run = bare.manifest.ensure(student=str(tokenizer_path), tokenizer_fingerprint="fp")
    write_rollout(bare, run, make_shard_id(2, "w00", 0), ["math"], seed=0)
    out = opd("inspect", bare.uri)
    assert out.returncode == 0, out.output
    assert "policy versions in rollouts: 2; published: none" in out.stdout
    assert "no annotations yet (run `opd annotate`)" in out.stdout


def test_export_from_and_to_an_s3_store(annotated_store, s3_store, s3_endpoint, monkeypatch, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # `opd export` reads no configuration: its Store(uri) reaches the server as pyarrow does, by AWS_ENDPOINT_URL
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)

    root = Path(annotated_store.root)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            s3_store.write_bytes(str(p.relative_to(root)), p.read_bytes())
    assert opd("export", annotated_store.uri, "--to", str(tmp_path / "local")).returncode == 0
    to = f"{s3_store.uri}-export"
    out = opd("export", s3_store.uri, "--to", to)
    assert out.returncode == 0, out.output
    for teacher in ("tA", "tB"):
        data = s3_store.fs.open_input_file(f"{to[len('s3://') :]}/{teacher}.parquet").read()
        assert pq.read_table(pa.BufferReader(data)).equals(pq.read_table(tmp_path / "local" / f"{teacher}.parquet"))
    again = opd("export", s3_store.uri, "--to", to)
    assert again.returncode == 2 and f"--to {to} is not empty" in " ".join(again.stderr.split())


def test_float16_parts_are_exported_widened_and_inspect_names_their_dtype(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opd_cache.storage.schema import annotated_table, list_lengths
    from tests.conftest import write_random_rollout_shard

    store = Store(tmp_path / "store")
    run = store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    shard = make_shard_id(0, "w00", 0)
    table = write_random_rollout_shard(store, shard_id=shard, num_rows=3, max_response=5, seed=4, run=run)
    lengths = list_lengths(table["response_ids"])
    rng = np.random.default_rng(1)
    total = int(lengths.sum())
    part = annotated_table(
        sample_ids=table["sample_id"].to_pylist(),
        lengths=lengths,
        topk_ids=rng.integers(0, 32, size=(total, 3)),
        topk_logprobs=-rng.random((total, 3)) * 5,
        token_logprob=-rng.random(total).astype(np.float32),
        logprob_dtype="float16",
    )
    write_annotated_part(store, run, shard, "t16", part, top_k=3)
    out = opd("export", store.uri, "--to", str(tmp_path / "out"), "--no-text")
    assert out.returncode == 0, out.output
    got = pq.read_table(tmp_path / "out" / "t16.parquet")
    assert got.schema.field("teacher_topk_logprobs").type == pa.list_(pa.list_(pa.float32()))
    expected = [
        [[float(np.float32(v)) for v in position] for position in row]
        for row in part["teacher_topk_logprobs"].to_pylist()
    ]
    assert got["teacher_topk_logprobs"].to_pylist() == expected  # float16 values, exactly, as float32
    assert (
        json.loads((tmp_path / "out" / "export.json").read_text())["teachers"]["t16"]["topk_logprob_dtype"] == "float16"
    )
    assert "top-k log-probs float16" in opd("inspect", store.uri).stdout
