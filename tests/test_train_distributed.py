"""Two processes under torchrun (gloo, FSDP2) train exactly like one, and their state resumes on one.

This runs in the default suite: one `torchrun --nproc_per_node 2` of four tiny steps (~20-30 s on two cores,
mostly interpreter start-up). It is the proof that the fused loss sees the full output-layer weight under
FSDP2 (the tied embedding is sharded outside the root's forward) and that gradients are summed, not averaged,
over ranks: otherwise the weights would differ from the single-process run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opd_cache.models import load_causal_lm
from opd_cache.storage import layout
from opd_cache.storage.store import Store
from opd_cache.train import run_train
from opd_cache.train.checkpoint import complete_states, read_ledger, verify_ledger
from tests.test_trainer import assert_same_weights, config, make_store, metrics, teacher  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def weights_of(store: Store, version: int) -> dict[str, torch.Tensor]:
    return dict(load_causal_lm(store.local_path(layout.policy_dir(version))).state_dict())


def torchrun_train(store: Store, *settings: str, timeout: int) -> None:
    """`opd train` on `store` in two processes (`torchrun --nproc_per_node 2`, one CPU thread each): four steps
    of 9 rows, micro-batches of 40 tokens, a version every 2 steps; `settings` are extra `--set key=value`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "opd_cache.cli", "train", "--store", store.uri, "--max-steps", "4"]
    command += ["--global-batch-samples", "9", "--micro-batch-tokens", "40", "--publish-every", "2"]
    command += ["--lr", "3e-4", "--max-staleness", "100"]
    for setting in settings:
        command += ["--set", setting]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def test_two_processes_equal_one_then_resume_on_one(tmp_path, tiny_model_factory, tokenizer, teacher):  # noqa: F811
    student = tiny_model_factory("student", seed=0)
    # 39 rows in batches of 9: four full steps, then a 3-row step whose rows cannot fill both ranks'
    # micro-batches (the short rank pads with empty ones); small micro-batches give several per rank.
    options = dict(max_steps=6, global_batch_samples=9, micro_batch_tokens=40, publish_every=2, save_every=2)
    one = make_store(tmp_path / "one", student, tokenizer, teacher, shards=3, rows=13)
    result = run_train(config(one, **options), one)
    assert result.step == 5 and result.stopped == "no more admissible data"

    two = make_store(tmp_path / "two", student, tokenizer, teacher, shards=3, rows=13)
    torchrun_train(two, "train.save_every=2", timeout=240)

    # same loss curve and the same weights at version 2 (step 4)
    losses_one = [m["loss"] for m in metrics(one)][:4]
    losses_two = [m["loss"] for m in metrics(two)]
    assert losses_two == pytest.approx(losses_one, abs=1e-6)
    # Adam hides a constant gradient scale, the clipped norm does not: summed (not averaged) over ranks
    grad_norms_one = [m["grad_norm"] for m in metrics(one)][:4]
    assert [m["grad_norm"] for m in metrics(two)] == pytest.approx(grad_norms_one, rel=1e-5)
    assert max(m["micro_batches"] for m in metrics(two)) >= 2
    assert_same_weights(weights_of(two, 2), weights_of(one, 2))
    assert complete_states(two) == [2, 4]
    assert sorted(p.name for p in two.local_path("train/state/step-000004").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    # the state saved by two ranks resumes in one process (DCP reshards) and ends where the 1-process run ended
    result = run_train(config(two, **options), two)
    assert result.step == 5
    assert_same_weights(weights_of(two, two.latest_version()), weights_of(one, one.latest_version()))
    assert read_ledger(two) == read_ledger(one)
    report = verify_ledger(two)
    assert report["trained"] == 39 and report["duplicates"] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 autocast on one device)")
def test_single_gpu_bf16_trains(tmp_path, tiny_model_factory, tokenizer, teacher):  # noqa: F811
    student = tiny_model_factory("student", seed=0)
    store = make_store(tmp_path / "gpu", student, tokenizer, teacher, shards=2, rows=32)
    result = run_train(
        config(store, max_steps=8, global_batch_samples=8, lr=3e-3, device="cuda", mixed_precision="auto"), store
    )
    assert result.step == 8
    losses = [m["loss"] for m in metrics(store)]
    assert all(map(lambda x: x == x, losses)) and min(losses[-3:]) < max(losses[:3])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL, FSDP2 on GPUs)")
def test_two_gpus_equal_one_gpu(tmp_path, tiny_model_factory, tokenizer, teacher):  # noqa: F811
    student = tiny_model_factory("student", seed=0)
    options = dict(
        max_steps=4,
        global_batch_samples=9,
        micro_batch_tokens=40,
        publish_every=2,
        device="cuda",
        mixed_precision="off",
    )
    one = make_store(tmp_path / "one", student, tokenizer, teacher, shards=3, rows=13)
    run_train(config(one, **options), one)
    two = make_store(tmp_path / "two", student, tokenizer, teacher, shards=3, rows=13)
    torchrun_train(two, "train.device=cuda", "train.mixed_precision=off", timeout=600)
    assert [m["loss"] for m in metrics(two)] == pytest.approx([m["loss"] for m in metrics(one)], abs=1e-5)
    assert_same_weights(weights_of(two, 2), weights_of(one, 2), atol=1e-4)
