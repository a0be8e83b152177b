"""Multi-turn rows in the trainer (schema version 2): annotations scattered to trained positions, no loss and no
gradient at tool-output tokens, and the trained tokens trained exactly as a hand computation and as the
equivalent single-turn row. Also: a version-1 shard (no mask, no schema-2 stamp) still trains."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from opd_cache.config import load_config
from opd_cache.export import teacher_batch
from opd_cache.losses import LossConfig
from opd_cache.models import build_tiny_model, load_causal_lm
from opd_cache.storage import layout
from opd_cache.storage.schema import ROLLOUT, ShardError, check_annotation_matches, read_shard, write_shard
from opd_cache.storage.store import Store, make_shard_id
from opd_cache.testing import write_synthetic_shard
from opd_cache.train import run_train
from opd_cache.train.microbatch import decode_rows
from opd_cache.train.objective import DistillationObjective
from opd_cache.train.shard_data import ShardCache, required_teachers
from opd_cache.train.stream import assign_ranks
from tests.test_train_stream import make_stream
from tests.test_trainer import make_store, teacher  # noqa: F401 (teacher: the peaked tiny teacher, a fixture)

V, K = 32, 4


@pytest.fixture
def run(local_store):
    return local_store.manifest.ensure(
        student="student", tokenizer_fingerprint="fp-test", vocab_size=V, top_k=K, teachers={"teacher": "teacher-path"}
    )


def conversation(rng, first: int, tool: int, second: int) -> tuple[np.ndarray, np.ndarray]:
    """A response of an assistant turn, a tool result and a second assistant turn, and its loss mask."""
    ids = rng.integers(1, V, size=first + tool + second)
    mask = np.array([1] * first + [0] * tool + [1] * second, dtype=np.uint8)
    return ids, mask


def write_rows(store, run, shard_id: str, responses: list, loss_masks: list | None = None, **fields) -> dict:
    """A synthetic shard of these responses (one row each) in this file's vocabulary and top-k; `fields`: more of
    `write_synthetic_shard`'s arguments (teachers, seed, prompts, annotate)."""
    return write_synthetic_shard(
        store,
        run,
        shard_id,
        num_rows=len(responses),
        vocab_size=V,
        top_k=K,
        responses=responses,
        loss_masks=loss_masks,
        **fields,
    )


def decode_all(cache, shard_id, rows, aggregation="token-mean"):
    data = cache.get(shard_id)
    rows = np.asarray(rows, dtype=np.int64)
    return decode_rows(
        cache,
        [shard_id],
        np.zeros(len(rows), dtype=np.int32),
        rows,
        aggregation=aggregation,
        global_tokens=int(data.trained_lengths[rows].sum()),
        global_seqs=len(rows),
    )


def test_decode_scatters_annotations_to_trained_positions(local_store, run):
    rng = np.random.default_rng(0)
    pairs = [conversation(rng, 3, 4, 5), conversation(rng, 2, 6, 1), (rng.integers(1, V, size=7), None)]
    shard_id = make_shard_id(0, "w00", 0)
    arrays = write_rows(local_store, run, shard_id, [ids for ids, _ in pairs], [mask for _, mask in pairs])
    rollout, _ = read_shard(local_store, layout.rollout_path(shard_id), kind=ROLLOUT)
    part, _ = read_shard(local_store, layout.annotated_path(shard_id, "teacher"))
    assert [len(x) for x in part["teacher_token_logprob"].to_pylist()] == [8, 3, 7]  # trained positions only

    cache = ShardCache(local_store, run, required_teachers(run))
    mb = decode_all(cache, shard_id, [0, 1, 2])
    trained = [np.ones(7, bool) if m is None else m == 1 for _, m in pairs]
    expected_ids = np.concatenate([r[t] for r, t in zip(arrays["responses"], trained)])
    np.testing.assert_array_equal(mb.sampled_ids.numpy(), expected_ids)
    np.testing.assert_array_equal(
        mb.teacher_topk_ids.numpy(),
        np.concatenate([np.reshape(x, (-1, K)) for x in part["teacher_topk_ids"].to_pylist()]),
    )
    # the input holds every token (tool output is context); each loss position predicts its own trained token
    for row, (prompt, response) in enumerate(zip(arrays["prompts"], arrays["responses"])):
        np.testing.assert_array_equal(mb.input_ids[row, : len(prompt) + len(response)].numpy(), np.r_[prompt, response])
    width = mb.input_ids.shape[1]
    predicted = mb.input_ids.flatten()[mb.response_positions + 1]
    np.testing.assert_array_equal(predicted.numpy(), expected_ids)
    assert mb.response_positions.numpy().max() < width * 3
    # token-mean over trained tokens only: 8 + 3 + 7 = 18
    torch.testing.assert_close(mb.token_weights, torch.full((18,), 1 / 18))
    # seq-mean-token-mean: each row's weights sum to 1 / rows, over its trained tokens
    mb = decode_all(cache, shard_id, [0, 1, 2], aggregation="seq-mean-token-mean")
    sums = [w.sum().item() for w in torch.split(mb.token_weights, [8, 3, 7])]
    np.testing.assert_allclose(sums, [1 / 3] * 3, rtol=1e-6)
    # the trainer's batch counts trained tokens for the token-mean denominator
    stream, _ = make_stream(local_store, run, batch_samples=3)
    batch = assign_ranks(stream.next_batch(1, 0), 1, 10_000)
    assert (batch.response_tokens, batch.global_seqs) == (18, 3)


def test_annotation_of_the_wrong_length_is_refused(local_store, run):
    rng = np.random.default_rng(1)
    ids, mask = conversation(rng, 3, 4, 5)
    shard_id = make_shard_id(0, "w00", 0)
    # a part written with an entry per response token (the old rule) does not match a masked row
    write_rows(local_store, run, shard_id, [ids])
    part, _ = read_shard(local_store, layout.annotated_path(shard_id, "teacher"))
    other = make_shard_id(0, "w00", 1)
    write_rows(local_store, run, other, [ids], [mask], annotate=False)
    rollout, _ = read_shard(local_store, layout.rollout_path(other))
    with pytest.raises(ShardError, match=r"row 0 has 12 teacher positions but its response has 8 tokens to train"):
        check_annotation_matches(rollout, part.set_column(0, "sample_id", rollout["sample_id"]), "part")


def _hidden_grad(model, objective, mb):
    """(loss, d loss / d last hidden state [B, L, H], parameter gradients) of one micro-batch."""
    captured = {}

    def keep(module, args, output):
        output.last_hidden_state.retain_grad()
        captured["hidden"] = output.last_hidden_state

    handle = model.base_model.register_forward_hook(keep)
    model.zero_grad()
    loss, _, _ = objective(mb)
    loss.backward()
    handle.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), captured["hidden"].grad, grads


def _bucket_forward_kl(student_logits, topk_ids, topk_logprobs):
    """KL(p || q) over the teacher's top-k plus one tail bucket, written out."""
    log_q = torch.log_softmax(student_logits.double(), -1)
    log_q_s = log_q.gather(1, topk_ids.long())
    log_p_s = topk_logprobs.double()
    p_tail = (1 - log_p_s.exp().sum(1)).clamp_min(1e-30)
    q_tail = 1 - log_q_s.exp().sum(1)
    return (log_p_s.exp() * (log_p_s - log_q_s)).sum(1) + p_tail * (p_tail.log() - q_tail.log())


def test_tool_tokens_get_zero_gradient_and_trained_tokens_match_a_hand_computation(local_store, run):
    teacher = build_tiny_model(vocab_size=V, seed=7, hidden_size=32, intermediate_size=64)
    student = build_tiny_model(vocab_size=V, seed=3, hidden_size=32, intermediate_size=64)
    rng = np.random.default_rng(2)
    ids, mask = conversation(rng, 4, 5, 6)
    shard_id = make_shard_id(0, "w00", 0)
    arrays = write_rows(local_store, run, shard_id, [ids], [mask], teachers={"teacher": teacher})
    mb = decode_all(ShardCache(local_store, run, required_teachers(run)), shard_id, [0])
    objective = DistillationObjective(student, LossConfig(divergence="forward_kl", tail="bucket"))
    loss, hidden_grad, grads = _hidden_grad(student, objective, mb)

    prompt = arrays["prompts"][0]
    P = len(prompt)
    # the hidden state that predicts response token t sits at P - 1 + t; tool tokens (mask 0) get exactly 0
    per_position = hidden_grad[0].abs().sum(-1)
    predicting = P - 1 + np.arange(len(ids))
    assert torch.all(per_position[predicting[mask == 0]] == 0)
    assert torch.all(per_position[predicting[mask == 1]] > 0)
    assert torch.all(per_position[: P - 1] == 0)

    # the same loss and gradients, by hand: the student's logits over the whole conversation, the teacher's
    # log-probs from a direct forward over it, the bucket KL at the 10 trained positions, their mean
    sequence = torch.from_numpy(np.r_[prompt, ids].astype(np.int64))[None]
    with torch.no_grad():
        teacher_lp = torch.log_softmax(teacher(input_ids=sequence).logits[0].float(), -1)[predicting[mask == 1]]
    top = teacher_lp.topk(K, -1)
    student.zero_grad()
    logits = student(input_ids=sequence).logits[0][predicting[mask == 1]]
    reference = _bucket_forward_kl(logits, top.indices, top.values).mean()
    reference.backward()
    torch.testing.assert_close(loss.double(), reference.detach(), rtol=1e-5, atol=1e-6)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_masked_row_trains_as_the_equivalent_single_turn_row(local_store, run):
    """Training only the last turn of a conversation is training a single-turn row whose prompt is the rest."""
    student = build_tiny_model(vocab_size=V, seed=5, hidden_size=32, intermediate_size=64)
    teacher = build_tiny_model(vocab_size=V, seed=9, hidden_size=32, intermediate_size=64)
    rng = np.random.default_rng(3)
    ids, _ = conversation(rng, 3, 4, 5)
    mask = np.array([0] * 7 + [1] * 5, dtype=np.uint8)
    multi = make_shard_id(0, "w00", 0)
    arrays = write_rows(local_store, run, multi, [ids], [mask], seed=4, teachers={"teacher": teacher})
    single = make_shard_id(0, "w00", 1)
    prompt = np.r_[arrays["prompts"][0], ids[:7]]
    write_rows(local_store, run, single, [ids[7:]], seed=4, teachers={"teacher": teacher}, prompts=[prompt])
    cache = ShardCache(local_store, run, required_teachers(run))
    objective = DistillationObjective(student, LossConfig(divergence="forward_kl", tail="bucket"))
    mb_multi, mb_single = decode_all(cache, multi, [0]), decode_all(cache, single, [0])
    assert torch.equal(mb_multi.input_ids, mb_single.input_ids)
    loss_multi, _, grads_multi = _hidden_grad(student, objective, mb_multi)
    loss_single, _, grads_single = _hidden_grad(student, objective, mb_single)
    torch.testing.assert_close(loss_multi, loss_single, rtol=1e-5, atol=1e-7)
    for name in grads_single:
        torch.testing.assert_close(grads_multi[name], grads_single[name], rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ whole training runs
def _store(root, student_path, tokenizer, teacher, *, masks: bool, shards: int = 2) -> Store:
    store = Store(root)
    rng = np.random.default_rng(11)
    for seq in range(shards):
        conversations = [conversation(rng, 4, 5, 6) for _ in range(16)]
        make_store(
            store,
            student_path,
            tokenizer,
            teacher,
            shards=1,
            rows=16,
            seq0=seq,
            top_k=K,
            responses=[ids % len(tokenizer) for ids, _ in conversations],
            loss_masks=[mask for _, mask in conversations] if masks else None,
        )
    return store


def _train(store: Store, steps: int, lr: float = 3e-4):
    overrides = {
        "store.uri": store.uri,
        "train.lr": lr,
        "train.max_steps": steps,
        "train.publish_every": 100,
        "train.save_every": 100,
        "train.global_batch_samples": 8,
    }
    return run_train(load_config(None, overrides=overrides), store)


def _as_version_1(store: Store) -> None:
    """Rewrite every shard of `store` as an older opd_cache wrote it: the same columns, stamped schema version 1."""
    for rel in [s.path for s in store.shards.rollouts()] + [
        layout.annotated_path(s.shard_id, "teacher") for s in store.shards.rollouts()
    ]:
        table, meta = read_shard(store, rel)
        store.delete(rel)
        write_shard(store, rel, table, replace(meta, schema_version=1))


def _weights(store: Store) -> dict[str, torch.Tensor]:
    model = load_causal_lm(store.local_path(layout.policy_dir(store.latest_version())))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_version_1_store_trains_exactly_as_before(tmp_path, tiny_model_factory, tokenizer, teacher):
    student = tiny_model_factory("student", seed=0)
    old = _store(tmp_path / "v1", student, tokenizer, teacher, masks=False)
    _as_version_1(old)
    info = old.shards.rollouts()[0]
    assert read_shard(old, info.path)[1].schema_version == 1
    assert read_shard(old, layout.annotated_path(info.shard_id, "teacher"))[1].schema_version == 1
    new = _store(tmp_path / "v2", student, tokenizer, teacher, masks=False)
    assert read_shard(new, info.path)[1].schema_version == 2
    assert _train(old, 3).step == 3 and _train(new, 3).step == 3
    old_weights, new_weights = _weights(old), _weights(new)
    for key in new_weights:  # single-turn rows train bit-identically whatever the stamp
        assert torch.equal(old_weights[key], new_weights[key]), key


def test_multi_turn_rows_train_and_their_masked_loss_falls(tmp_path, tiny_model_factory, tokenizer, teacher):
    student = tiny_model_factory("student", seed=0)
    store = _store(tmp_path / "store", student, tokenizer, teacher, masks=True, shards=6)
    result = _train(store, 12, lr=3e-3)
    assert result.step == 12
    losses = [json.loads(line)["loss"] for line in store.read_bytes("metrics/train-0.jsonl").decode().splitlines()]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


def test_export_places_teacher_entries_with_the_mask(local_store, run):
    rng = np.random.default_rng(5)
    pairs = [conversation(rng, 3, 4, 5), (rng.integers(1, V, size=6), None)]
    shard_id = make_shard_id(0, "w00", 0)
    write_rows(local_store, run, shard_id, [ids for ids, _ in pairs], [mask for _, mask in pairs])
    batch = teacher_batch(local_store, run, shard_id, "teacher", tokenizer=None)
    part, _ = read_shard(local_store, layout.annotated_path(shard_id, "teacher"))
    assert batch.column("loss_mask").to_pylist() == [pairs[0][1].tolist(), [1] * 6]
    assert batch.column("teacher_token_logprob").to_pylist() == part["teacher_token_logprob"].to_pylist()
    assert [len(x) for x in batch.column("teacher_topk_ids").to_pylist()] == [8, 6]
