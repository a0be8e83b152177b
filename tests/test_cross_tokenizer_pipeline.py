"""Cross-tokenizer OPD end to end, at demo size (issue #27): a tiny student with the BPE tokenizer
(data/tokenizer_bpe) distilled from the shipped character-level teacher on the arithmetic task.

rollout (BPE student) -> annotate with `annotate.cross_tokenizer` (the teacher scores its own tokenization; the
part carries target_flags, top-k in student ids, group log-probs) -> the real trainer (shard_data, microbatch,
objective with fused_cross_tokenizer_losses). The test checks the store, that the loss falls, and that the student
moves toward the teacher on text it never trained on: the student's log-prob per character of the teacher's own
greedy answers to held-out prompts (an agreement measured on text, so the tokenizers do not matter).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from opd_cache.config import load_config
from opd_cache.models import build_tiny_model, load_causal_lm, save_causal_lm
from opd_cache.observe.metrics import read_metrics
from opd_cache.storage import layout
from opd_cache.storage.schema import ANNOTATED, TARGET_FLAGS, read_shard
from opd_cache.storage.store import Store
from opd_cache.target_flags import EXCLUDED, GROUP_END, TOPK_VALID
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests.conftest import REPO, load_data_script

TEACHER = REPO / "data/models/teacher"
STEPS, BATCH = 8, 16
SFT_STEPS = 40


@pytest.fixture(scope="module")
def bpe_student(tmp_path_factory):
    """A 2-layer student with the BPE tokenizer, briefly supervised on the demo student's " ans= N" answers (as
    data/make_demo_models.py trains the shipped one, for far fewer steps): it writes text, not random bytes."""
    from opd_cache.tasks.arithmetic import student_answer
    from opd_cache.tasks.prompts import load_prompts

    make_models = load_data_script("make_demo_models")
    tok = load_tokenizer(REPO / "data/tokenizer_bpe")
    model = build_tiny_model(
        vocab_size=len(tok),
        seed=1,
        hidden_size=64,
        num_layers=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    train = load_prompts(REPO / "data/arithmetic/train.parquet", tok)
    input_ids, labels = make_models.make_batch_tensors(train, tok, student_answer)
    make_models.supervise(model, input_ids, labels, steps=SFT_STEPS, batch_size=64, lr=3e-3, seed=1, name="bpe")
    out = tmp_path_factory.mktemp("bpe") / "student"
    save_causal_lm(model, tok, out)
    return out


def held_out_agreement(student_path, prompts: list[str], answers: list[str]) -> float:
    """The student's mean log-prob per character of `answers` after its own rendering of `prompts`."""
    from opd_cache.annotate.cross_tokenizer import render_prompt

    tok = load_tokenizer(student_path)
    model = load_causal_lm(student_path).eval()
    total, chars = 0.0, 0
    with torch.no_grad():
        for prompt, answer in zip(prompts, answers, strict=True):
            p = render_prompt(tok, [{"role": "user", "content": prompt}])
            a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([p + a])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            total += float(logp[len(p) - 1 :].gather(1, ids[0, len(p) :, None]).sum())
            chars += len(answer) + 1
    return total / chars


def teacher_answers(prompts: list[str]) -> list[str]:
    """The teacher's greedy answers (its own tokenization), as text."""
    from opd_cache.annotate.cross_tokenizer import render_prompt

    tok = load_tokenizer(TEACHER)
    model = load_causal_lm(TEACHER).eval()
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([render_prompt(tok, [{"role": "user", "content": prompt}])])
            out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=tok.eos_token_id)
            answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


def test_cross_tokenizer_run_trains_the_bpe_student_toward_the_teacher(tmp_path, bpe_student, monkeypatch):
    from opd_cache.annotate import run_annotate
    from opd_cache.rollout import run_rollout
    from opd_cache.train.trainer import run_train

    store_dir = tmp_path / "store"
    cfg = load_config(
        overrides={
            "store.uri": str(store_dir),
            "max_staleness": STEPS,  # every row is sampled by version 0 before training: all may train
            "rollout.student": str(bpe_student),
            "rollout.prompts": str(REPO / "data/arithmetic/train.parquet"),
            "rollout.n": 4,
            "rollout.batch_prompts": 4,
            "rollout.flush_rows": BATCH,
            "rollout.max_samples": STEPS * BATCH,
            "rollout.sampling.max_new_tokens": 10,
            "annotate.teacher": str(TEACHER),
            "annotate.top_k": 8,
            "annotate.cross_tokenizer": True,
            "annotate.cross_tokenizer_topk": "group_start",
            "train.max_steps": STEPS,
            "train.global_batch_samples": BATCH,
            "train.lr": 5e-3,
            "train.publish_every": STEPS,
            "train.save_every": STEPS,
        }
    )
    store = Store(cfg.store.uri)
    test = pq.read_table(REPO / "data/arithmetic/test.parquet").to_pylist()[:12]
    prompts = [row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"] for row in test]
    answers = teacher_answers(prompts)
    before = held_out_agreement(bpe_student, prompts, answers)

    run_rollout(cfg, store)
    run_annotate(cfg, store)

    # the store: the teacher registered with its own tokenizer and the map; parts with flags in student ids
    student_tok, teacher_tok = load_tokenizer(bpe_student), load_tokenizer(TEACHER)
    (record,) = store.manifest.teachers()
    assert record.tokenizer_fingerprint == tokenizer_fingerprint(student_tok)
    assert record.teacher_tokenizer_fingerprint == tokenizer_fingerprint(teacher_tok)
    assert record.vocab_map_fingerprint and record.cross_tokenizer_topk == "group_start"
    assert record.vocab_size == len(student_tok)
    shards = [info.shard_id for info in store.shards.rollouts()]
    assert len(shards) == STEPS
    part, meta = read_shard(store, layout.annotated_path(shards[0], "teacher"), kind=ANNOTATED)
    flags = np.concatenate(part[TARGET_FLAGS].to_pylist())
    assert (flags & GROUP_END).any() and (flags & TOPK_VALID).any()
    assert not (flags & EXCLUDED).all()
    assert np.concatenate(part["teacher_topk_ids"].to_pylist()).max() < len(student_tok)

    result = run_train(cfg, store)
    assert result.step == STEPS
    records = [r for log in read_metrics(store, "train").values() for r in log if "loss" in r]
    losses = [r["loss"] for r in sorted(records, key=lambda r: r["step"])]
    assert len(losses) == STEPS
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:2]), losses

    after = held_out_agreement(store.local_dir(layout.policy_dir(result.policy_version)), prompts, answers)
    assert after > before + 0.05, (before, after)  # nats per character

    # the tools read the store: export (the flags column), inspect (flag summary, the groups), verify
    from typer.testing import CliRunner

    import opd_cache.cli  # noqa: F401  (registers the commands)
    from opd_cache.cli.common import app
    from opd_cache.export import export_store
    from opd_cache.storage.integrity import verify_store

    exported = export_store(store, str(tmp_path / "export"), text=False)
    table = pq.read_table(exported.files["teacher"])
    assert table.num_rows == STEPS * BATCH
    flag_lengths = table["target_flags"].combine_chunks().value_lengths().to_numpy()
    np.testing.assert_array_equal(flag_lengths, table["response_ids"].combine_chunks().value_lengths().to_numpy())
    report = verify_store(store)
    assert not report.problems and report.ok >= 2 * STEPS
    part_path = store.path(layout.annotated_path(shards[0], "teacher"))
    shown = CliRunner().invoke(app, ["inspect", part_path, "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output)["cross_tokenizer"]
    assert 0 < summary["topk_valid_share"] <= 1 and summary["groups"] > 0
    # the per-token view of a row the alignment kept: flags and each group's text at its end
    from rich.console import Console

    from opd_cache.cli import inspect as inspect_cli

    row = int(np.argmax([not (f[0] & EXCLUDED) for f in part[TARGET_FLAGS].to_pylist()]))
    monkeypatch.setattr(inspect_cli, "console", Console(width=200, record=True))
    inspect_cli.inspect_command(part_path, sample=row, tokenizer_path=None, teacher=None, as_json=False)
    shown = inspect_cli.console.export_text()
    assert "group text" in shown and "group_end" in shown and "cross_tokenizer" in shown


EXAMPLE_STEPS = 800


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """examples/arithmetic_xtok_cpu/config.yaml under `opd run` as shipped, 800 steps (~5.5 min at load ~9; strict
    0.835-0.885 in three runs, but 0.84 and 0.325 in two runs of 600; with a version every 2 steps and a shard per
    version, 0.97 at ~2 min: docs/cross-tokenizer.md, "The demo"):
    rollout, cross-tokenizer annotate, train, evaluation. Returns the store's folder."""
    import subprocess
    import sys

    student = REPO / "data/models/student_bpe"
    if not (student / "model.safetensors").exists():
        pytest.fail("data/models/student_bpe is missing: python data/make_bpe_student.py")
    store_dir = tmp_path_factory.mktemp("xtok") / "store"
    cmd = [sys.executable, "-m", "opd_cache.cli", "run", "--config", "examples/arithmetic_xtok_cpu/config.yaml"]
    cmd += ["--set", f"store.uri={store_dir}", "--set", f"train.max_steps={EXAMPLE_STEPS}"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return store_dir


@pytest.mark.slow
def test_opd_run_of_the_cross_tokenizer_example(example_run):
    """Every stage finishes, the teacher's record names the cross-tokenizer rule, every trained shard has a
    part with flags."""
    store = Store(example_run)
    assert store.is_done()
    (record,) = store.manifest.teachers()
    assert record.teacher_tokenizer_fingerprint and record.cross_tokenizer_topk == "group_start"
    parts = store.shards.annotated_parts()
    assert parts and all("teacher" in teachers for teachers in parts.values())
    shard_id = sorted(parts)[0]
    part, _ = read_shard(store, layout.annotated_path(shard_id, "teacher"), kind=ANNOTATED)
    assert TARGET_FLAGS in part.schema.names


@pytest.mark.slow
def test_the_cross_tokenizer_example_meets_issue_27s_bar(example_run):
    """Issue #27's bar on 200 held-out prompts, measured by examples/arithmetic_xtok_cpu/measure.py: strict
    accuracy at least 0.8x the teacher's, and the KL in the teacher's tokenization (the teacher against the
    student's next byte, at every character of the student's greedy answers) at least 5x lower than before
    training (docs/cross-tokenizer.md, "The demo")."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("measure", REPO / "examples/arithmetic_xtok_cpu/measure.py")
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    report = measure.measure(str(example_run))
    before, after = report["before"], report["after"]
    assert report["prompts"] == 200 and report["teacher"]["strict"] >= 0.95, report
    assert before["strict"] <= 0.05, report  # it starts in its own format: strict near 0, as the demo's student
    assert after["kl_excluded_rows"] == 0 and after["kl_positions"] >= 200 * 8, report  # ' #### N<eos>' >= 8
    assert before["kl"] >= 5 * after["kl"], report
    assert after["strict"] >= 0.8 * report["teacher"]["strict"], report
