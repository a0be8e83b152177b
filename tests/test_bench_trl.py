"""The inputs benchmarks/bench_trl.py gives TRL's GKDTrainer: built without TRL, so tested without it."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_trl  # noqa: E402

from opd_cache.launch.demo import demo_config  # noqa: E402
from opd_cache.rollout.prompt_stream import epoch_order  # noqa: E402
from opd_cache.tasks.prompts import load_prompts  # noqa: E402
from opd_cache.tokenizer import load_tokenizer  # noqa: E402


def test_collate_left_pads_prompts_and_carries_no_labels():
    batch = bench_trl.collate_prompts([{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [8]}], pad_token_id=0)
    assert batch["prompts"].tolist() == [[5, 6, 7], [0, 0, 8]]  # generate() continues from the right end
    assert batch["prompt_attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["input_ids"].tolist() == batch["prompts"].tolist()
    # labels would make the HF Trainer divide the loss by the prompt batch's label count
    assert "labels" not in batch


def test_trl_rows_are_the_rollout_workers_prompts_n_times_each(tmp_path):
    cfg = demo_config(tmp_path, seed=0, sets=[])
    tokenizer = load_tokenizer(cfg.rollout.student)
    rows = bench_trl.trl_prompt_rows(cfg, steps=2, tokenizer=tokenizer)
    n = cfg.rollout.n
    assert len(rows) == 2 * cfg.train.global_batch_samples
    groups = [rows[i : i + n] for i in range(0, len(rows), n)]
    assert all(g == [g[0]] * n for g in groups)  # n samples of one prompt, in a row, as rollout samples them
    prompts = load_prompts(cfg.rollout.prompts, tokenizer)
    order = epoch_order(len(prompts), cfg.rollout.seed, cfg.rollout.worker_id, 0)
    assert [g[0] for g in groups] == [list(prompts.prompt_ids[i]) for i in order[: len(groups)]]
