"""The store evaluator (`opd run`'s fourth process, `opd eval --follow`): what it leaves behind on a remote store."""

from __future__ import annotations

import tempfile

from opd_cache.evaluate import evaluate_store
from opd_cache.tokenizer import tokenizer_fingerprint
from tests.conftest import REPO


def test_the_evaluator_removes_each_downloaded_version_of_a_remote_store(
    s3_store, tokenizer, tiny_model_factory, tmp_path, monkeypatch
):
    """Each evaluated version of an S3 store is downloaded to a temp folder; a run evaluates dozens of them, so
    each copy must be gone once its evaluation is (they used to stay: a 1B student every 25 steps fills a disk)."""
    student = tiny_model_factory("student", seed=0)
    s3_store.manifest.ensure(
        student=str(student), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=len(tokenizer)
    )
    for version in (1, 2):
        s3_store.publish_policy(version, tiny_model_factory("student", seed=version))
    s3_store.mark_done()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    results = evaluate_store(
        s3_store,
        str(REPO / "data/arithmetic/test.parquet"),
        teacher_path=None,
        max_prompts=2,
        max_new_tokens=4,
        follow=False,
        device="cpu",
    )

    assert [r["version"] for r in results] == [0, 1, 2]
    assert results[1]["strict"] is not None  # evaluated from the downloaded copy
    assert sorted(p.name for p in scratch.iterdir()) == []
