"""The evaluators (`opd run`'s fourth process, `opd eval`, `opd eval --follow`): what they leave behind when the
model is a version of a remote store."""

from __future__ import annotations

import json
import tempfile

from typer.testing import CliRunner

from opd_cache.cli import app
from opd_cache.evaluate import evaluate_store
from opd_cache.tokenizer import tokenizer_fingerprint
from tests.conftest import REPO


def s3_run_with_two_versions(s3_store, tokenizer, tiny_model_factory, tmp_path, monkeypatch):
    """The S3 store holds a finished run with versions 1 and 2; the temp folder is an empty one of the test's."""
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
    return scratch


def test_the_evaluator_removes_each_downloaded_version_of_a_remote_store(
    s3_store, tokenizer, tiny_model_factory, tmp_path, monkeypatch
):
    """Each evaluated version of an S3 store is downloaded to a temp folder; a run evaluates dozens of them, so
    each copy must be gone once its evaluation is (they used to stay: a 1B student every 25 steps fills a disk)."""
    scratch = s3_run_with_two_versions(s3_store, tokenizer, tiny_model_factory, tmp_path, monkeypatch)

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


def test_opd_eval_of_a_remote_store_removes_the_version_it_downloaded(
    s3_store, s3_endpoint, tokenizer, tiny_model_factory, tmp_path, monkeypatch
):
    """`opd eval --model s3://…` evaluates the newest version from a download that is gone when it returns."""
    scratch = s3_run_with_two_versions(s3_store, tokenizer, tiny_model_factory, tmp_path, monkeypatch)
    prompts = ["--prompts", str(REPO / "data/arithmetic/test.parquet"), "--max-prompts", "2", "--max-new-tokens", "4"]
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            s3_store.uri,
            *prompts,
            "--device",
            "cpu",
            "--json",
            "--set",
            f"store.s3_endpoint={s3_endpoint}",
        ],
    )
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output.strip().splitlines()[-1])
    assert printed["version"] == 2
    assert printed["model"] == s3_store.uri  # not the temp folder the download lived in, gone by now
    assert sorted(p.name for p in scratch.iterdir()) == []
