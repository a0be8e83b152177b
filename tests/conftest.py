"""Shared fixtures: the shipped tiny tokenizer, tiny models built from a config, stores, synthetic shards."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
TOKENIZER_DIR = DATA / "tokenizer"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub; fail fast instead of timing out


def load_data_script(name: str):
    """One of the scripts shipped in data/ (data/NAME.py), imported as a module."""
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread for every test: tiny models and tensors only wait on a second OpenMP thread, and on
    this shared 2-core machine its spinning made them 20-30x slower. Stages started as processes set their own
    (OMP_NUM_THREADS)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    from opd_cache.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_path)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tokenizer):
    """`make(name, seed=0, **kwargs) -> Path`: a tiny causal LM saved as an HF checkpoint (cached per session)."""
    from opd_cache.models import build_tiny_model, save_causal_lm

    root = tmp_path_factory.mktemp("models")
    cache: dict = {}

    def make(name: str = "student", seed: int = 0, **kwargs) -> Path:
        key = (name, seed, tuple(sorted(kwargs.items())))
        if key not in cache:
            model = build_tiny_model(vocab_size=len(tokenizer), seed=seed, **kwargs)
            out = root / f"{name}-{seed}-{len(cache)}"
            save_causal_lm(model, tokenizer, out)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture
def local_store(tmp_path):
    from opd_cache.storage.store import Store

    return Store(tmp_path / "store")


@pytest.fixture
def student_store(local_store, tokenizer, tiny_model_factory):
    """A local store whose run.json carries the shipped tokenizer's fingerprint and a loadable tiny student."""
    from opd_cache.tokenizer import tokenizer_fingerprint

    local_store.manifest.ensure(
        student=str(tiny_model_factory("student", seed=0)),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=len(tokenizer),
    )
    return local_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3-compatible server (moto) on 127.0.0.1 for the session; skips only if it cannot start."""
    try:
        import moto  # noqa: F401
    except ImportError:
        pytest.skip("moto[server] is not installed (pip install -e '.[dev]')")
    port = _free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.skip("moto server did not start on 127.0.0.1 within 20 s")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_store(s3_endpoint, monkeypatch, request):
    """A Store on a fresh bucket of the moto server."""
    from opd_cache.storage.store import Store

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = "b" + request.node.name.lower().replace("_", "-")[:40].strip("-") + str(int(time.time() * 1000) % 100000)
    bucket = "".join(c for c in bucket if c.isalnum() or c == "-")
    store = Store(f"s3://{bucket}/run", s3_endpoint=s3_endpoint)
    store.fs.create_dir(bucket)
    return store


def write_random_rollout_shard(
    store,
    *,
    shard_id: str,
    num_rows: int = 4,
    vocab_size: int = 32,
    prompt_len: int = 5,
    max_response: int = 6,
    seed: int = 0,
    run: dict | None = None,
    student_topk: int = 0,
    data_source: str | None = None,
):
    """A syntactically valid rollout shard with random tokens (for storage/annotate/train tests)."""
    from opd_cache.storage.schema import rollout_table
    from opd_cache.storage.store import parse_shard_id
    from opd_cache.testing import write_rollout_shard

    rng = np.random.default_rng(seed)
    version, _, _ = parse_shard_id(shard_id)
    run = run or store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    lengths = rng.integers(0, max_response + 1, size=num_rows)
    table = rollout_table(
        sample_ids=[f"{shard_id}-{i}" for i in range(num_rows)],
        prompt_index=np.arange(num_rows),
        sample_index=np.zeros(num_rows),
        prompt_ids=[rng.integers(1, vocab_size, size=prompt_len) for _ in range(num_rows)],
        response_ids=[rng.integers(1, vocab_size, size=n) for n in lengths],
        behavior_logprobs=[-rng.random(n) for n in lengths],
        policy_version=version,
        finish_reason=["stop"] * num_rows,
        data_source=[data_source] * num_rows if data_source else None,
        student_topk_ids=[rng.integers(0, vocab_size, size=(n, student_topk)) for n in lengths]
        if student_topk
        else None,
        student_topk=student_topk,
    )
    write_rollout_shard(store, run, shard_id, table, student_topk=student_topk)
    return table
