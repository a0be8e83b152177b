"""Every shard records the engine, its version and the model dtype that produced it; `opd inspect` shows them.

The hf engines here (the default tier); the vLLM engines' shards in tests/test_vllm_engines.py (`-m vllm`).
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

from opd_cache.annotate import run_annotate
from opd_cache.config import AnnotateConfig, Config, RolloutConfig, SamplingConfig
from opd_cache.rollout import run_rollout
from opd_cache.storage import layout
from opd_cache.storage.schema import ANNOTATED, ROLLOUT, read_shard
from tests.test_cli_inspect import opd
from tests.test_rollout import questions, write_prompts


def test_rollout_and_annotate_shards_name_their_engine_and_dtype(tiny_model_factory, local_store, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        student, teacher = tiny_model_factory("student"), tiny_model_factory("teacher", seed=1)
        prompts = write_prompts(tmp_path / "p.jsonl", questions(2))
        run_rollout(
            Config(
                rollout=RolloutConfig(
                    student=str(student),
                    prompts=str(prompts),
                    n=2,
                    max_samples=4,
                    flush_rows=4,
                    sampling=SamplingConfig(max_new_tokens=4),
                )
            ),
            local_store,
        )
        run_annotate(
            Config(annotate=AnnotateConfig(teacher=str(teacher), top_k=4, model_dtype="bfloat16")), local_store
        )
    finally:
        torch.set_num_threads(threads)
    (info,) = local_store.shards.rollouts()
    _, rollout_meta = read_shard(local_store, info.path, kind=ROLLOUT)
    assert (rollout_meta.engine, rollout_meta.engine_version, rollout_meta.model_dtype) == (
        "hf",
        transformers.__version__,
        "float32",
    )
    part_path = layout.annotated_path(info.shard_id, "teacher")
    table, part_meta = read_shard(local_store, part_path, kind=ANNOTATED)
    assert (part_meta.engine, part_meta.model_dtype) == ("hf", "bfloat16")  # the teacher ran in bfloat16
    assert table.schema.metadata[b"opd.engine"] == b"hf" and table.schema.metadata[b"opd.model_dtype"] == b"bfloat16"
    assert np.isfinite(np.concatenate(table["teacher_token_logprob"].to_pylist() or [[0.0]])).all()

    out = opd("inspect", str(local_store.local_path(part_path)))
    assert out.returncode == 0, out.output
    # one line per metadata key (named as stored, opd.engine, or as the ShardMeta field, engine)
    shown = {
        line.split()[0].removeprefix("opd."): line.split()[1:]
        for line in out.stdout.splitlines()
        if line.startswith("  ") and len(line.split()) >= 2
    }
    assert shown["engine"] == ["hf"] and shown["model_dtype"] == ["bfloat16"], out.stdout
    assert shown["engine_version"] == [transformers.__version__]
