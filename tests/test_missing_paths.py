"""A missing local model folder or prompt file is one clear line, before anything loads; a hub id stays a hub id."""

from __future__ import annotations

from pathlib import Path

import pytest

from opd_cache.models import check_model_path, looks_local
from tests.test_cli_inspect import opd

REPO = Path(__file__).resolve().parents[1]
PROMPTS = str(REPO / "data/arithmetic/train.parquet")
STUDENT = str(REPO / "data/models/student")


def error_line(out) -> str:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    return " ".join(out.stderr.split())


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if a tokenizer or model is loaded: the checks must come first."""
    import opd_cache.evaluate
    import opd_cache.rollout.worker
    import opd_cache.tokenizer

    def refuse(*args, **kwargs):
        raise AssertionError(f"loaded {args} before checking the inputs")

    for module in (opd_cache.tokenizer, opd_cache.rollout.worker, opd_cache.evaluate):
        monkeypatch.setattr(module, "load_tokenizer", refuse)
    monkeypatch.setattr(opd_cache.evaluate, "load_causal_lm", refuse, raising=False)


def test_rollout_names_the_missing_student_folder(tmp_path, nothing_loads):
    line = error_line(opd("rollout", "--store", str(tmp_path / "s"), "--student", "/nonexistent", "--prompts", PROMPTS))
    assert "error: --student: model folder /nonexistent does not exist" in line
    assert "Repo id" not in line
    assert not (tmp_path / "s" / "run.json").exists()


def test_relative_paths_count_as_local(tmp_path, monkeypatch, nothing_loads):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for path in ("models/student", "./student", "../student", "runs/demo/policy/v000003"):
        line = error_line(opd("rollout", "--store", "s", "--student", path, "--prompts", PROMPTS))
        assert f"error: --student: model folder {path} does not exist" in line
    (tmp_path / "models" / "file").write_text("x")
    line = error_line(opd("rollout", "--store", "s", "--student", "models/file", "--prompts", PROMPTS))
    assert "error: --student: model folder models/file is a file, not a folder" in line


def test_a_hub_id_is_left_to_the_hub_and_prompts_are_checked_before_any_model_loads(tmp_path, nothing_loads):
    line = error_line(
        opd(
            "rollout",
            "--store",
            str(tmp_path / "s"),
            "--student",
            "Qwen/Qwen3-0.6B",
            "--prompts",
            str(tmp_path / "nope.parquet"),
        )
    )
    assert f"error: prompts file {tmp_path / 'nope.parquet'} does not exist" in line
    assert not looks_local("Qwen/Qwen3-0.6B") and not looks_local("gpt2")
    check_model_path("Qwen/Qwen3-0.6B", "--student")  # no error: it may be downloadable elsewhere


def test_annotate_names_the_missing_teacher_folder(tmp_path):
    line = error_line(opd("annotate", "--store", str(tmp_path / "s"), "--teacher", "/nonexistent"))
    assert "error: --teacher: model folder /nonexistent does not exist" in line


def test_eval_names_the_missing_model_teacher_and_prompts(tmp_path, nothing_loads):
    line = error_line(opd("eval", "--model", "/nonexistent", "--prompts", PROMPTS))
    assert "error: --model: model folder /nonexistent does not exist" in line
    line = error_line(opd("eval", "--model", STUDENT, "--teacher", str(tmp_path / "teacher"), "--prompts", PROMPTS))
    assert f"error: --teacher: model folder {tmp_path / 'teacher'} does not exist" in line
    line = error_line(opd("eval", "--model", STUDENT, "--prompts", str(tmp_path / "nope.parquet")))
    assert f"error: prompts file {tmp_path / 'nope.parquet'} does not exist" in line


def test_train_names_the_missing_student_folder(tmp_path):
    line = error_line(opd("train", "--store", str(tmp_path / "s"), "--student", "/nonexistent"))
    assert "error: --student: model folder /nonexistent does not exist" in line
