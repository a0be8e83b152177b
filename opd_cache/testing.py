"""Synthetic rollout + annotated shards, for the trainer's tests and benchmarks.

Prompts and responses are random token sequences. The annotation is either
real — a teacher model's top-k log-probs at every response position, computed
exactly as `opd annotate` defines them (log-softmax of the teacher's logits at
temperature 1, top-k sorted descending, plus the log-prob of the sampled
token) — or random but well-formed (sorted log-probs whose mass is < 1) when no
teacher is given. Behavior log-probs come from a `behavior` model when one is
given (so importance ratios are exactly 1 at version 0), else are random.

`write_synthetic_store` writes a whole store's worth of such shards (what the benchmarks start from).

Also the scaffolding tests and benchmarks share: writing one rollout shard or annotated part from a table
(`write_rollout_shard`, `write_annotated_part`) and a filesystem that counts its requests (`CountingFileSystem`).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pyarrow.fs as pafs
import torch

from opd_cache.storage import layout
from opd_cache.storage.manifest import RunManifest
from opd_cache.storage.schema import ANNOTATED, ROLLOUT, ShardMeta, annotated_table, rollout_table, write_shard
from opd_cache.storage.store import Store, make_shard_id, parse_shard_id


@torch.no_grad()
def response_logprobs(model, prompts: list[np.ndarray], responses: list[np.ndarray]) -> list[torch.Tensor]:
    """Full-vocabulary log-probs [R_i, V] of each response position under `model` (one padded forward)."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):  # test-data helper, not a hot path
        seq = np.concatenate([p, r])
        ids[i, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
        mask[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        out.append(torch.log_softmax(logits[i, len(p) - 1 : len(p) - 1 + len(r)], dim=-1))
    return out


def shard_meta(run: dict, shard_id: str, kind: str, **fields) -> ShardMeta:
    """The metadata of shard `shard_id` of `run` (its policy version from the id); `fields`: the kind's own."""
    return ShardMeta(
        kind=kind,
        run_id=run["run_id"],
        tokenizer_fingerprint=run["tokenizer_fingerprint"],
        shard_id=shard_id,
        policy_version=parse_shard_id(shard_id)[0],
        **fields,
    )


def write_rollout_shard(store: Store, run: dict, shard_id: str, table, *, student_topk: int = 0) -> str:
    """Publish a rollout table as shard `shard_id` of `run`; returns its store path."""
    rel = layout.rollout_path(shard_id)
    write_shard(store, rel, table, shard_meta(run, shard_id, ROLLOUT, student_topk=student_topk))
    return rel


def write_annotated_part(
    store: Store,
    run: dict,
    shard_id: str,
    teacher: str,
    table,
    *,
    top_k: int,
    student_topk: int = 0,
    rel: str | None = None,
    compression: str | None = None,
) -> str:
    """Publish `teacher`'s annotated part of shard `shard_id` (at `rel`, default its store path); returns the path."""
    rel = rel or layout.annotated_path(shard_id, teacher)
    meta = shard_meta(run, shard_id, ANNOTATED, top_k=top_k, teacher=teacher, student_topk=student_topk)
    write_shard(store, rel, table, meta, compression=compression)
    return rel


def write_synthetic_shard(
    store: Store,
    run: dict,
    shard_id: str,
    *,
    num_rows: int,
    vocab_size: int,
    top_k: int,
    prompt_len: tuple[int, int] = (4, 8),
    response_len: tuple[int, int] = (1, 12),
    seed: int = 0,
    teachers: dict | None = None,
    routing: dict[str, str] | None = None,
    data_sources: list[str] | None = None,
    behavior=None,
    student_topk: int = 0,
    logprob_dtype: str = "float32",
    ground_truth: list[str] | None = None,
    group_size: int = 1,
    responses: list[np.ndarray] | None = None,
    prompts: list[np.ndarray] | None = None,
    annotate: bool = True,
    loss_masks: list | None = None,
) -> dict:
    """Write `rollouts/v<version>/<shard_id>.arrow` and one annotated part per teacher; returns the row arrays.

    `teachers`: {name: model or None (random annotation)}; default one random teacher "teacher".
    `routing`: data_source value -> teacher name (rows with other values go to no teacher).
    `group_size`: consecutive rows share a prompt (GRPO groups).
    `loss_masks`: one 0/1 array per row (None entries: single-turn rows) makes multi-turn rows (schema version 2):
    behavior log-probs 0 where the mask is 0, and the parts hold the teacher's entries at mask-1 positions only.
    """
    rng = np.random.default_rng(seed)
    version = parse_shard_id(shard_id)[0]
    teachers = teachers if teachers is not None else {"teacher": None}
    n_prompts = -(-num_rows // group_size)
    prompt_pool = [
        rng.integers(1, vocab_size, size=int(rng.integers(prompt_len[0], prompt_len[1] + 1))) for _ in range(n_prompts)
    ]
    if prompts is None:
        prompts = [prompt_pool[i // group_size] for i in range(num_rows)]
    if responses is None:
        responses = [
            rng.integers(1, vocab_size, size=int(rng.integers(response_len[0], response_len[1] + 1)))
            for _ in range(num_rows)
        ]
    sample_ids = [f"{shard_id}-{i}" for i in range(num_rows)]
    if behavior is not None:
        lps = response_logprobs(behavior, prompts, responses)
        behavior_lp = [
            lp.gather(1, torch.from_numpy(r.astype(np.int64))[:, None]).squeeze(1).numpy()
            for lp, r in zip(lps, responses)
        ]
        topk_s = [lp.topk(student_topk, dim=-1).indices.numpy() for lp in lps] if student_topk else None
    else:
        behavior_lp = [-rng.random(len(r)).astype(np.float32) - 0.05 for r in responses]
        topk_s = [rng.integers(0, vocab_size, size=(len(r), student_topk)) for r in responses] if student_topk else None
    masks = None
    if loss_masks is not None:
        masks = [None if m is None else np.asarray(m, dtype=np.uint8) for m in loss_masks]
        behavior_lp = [
            b if m is None else np.where(m == 1, b, 0.0).astype(np.float32) for b, m in zip(behavior_lp, masks)
        ]
    trained = [
        np.ones(len(r), dtype=bool) if m is None else m == 1 for r, m in zip(responses, masks or [None] * num_rows)
    ]
    table = rollout_table(
        sample_ids=sample_ids,
        prompt_index=np.arange(num_rows) // group_size + 1000 * parse_shard_id(shard_id)[2],
        sample_index=np.arange(num_rows) % group_size,
        prompt_ids=prompts,
        response_ids=responses,
        behavior_logprobs=behavior_lp,
        policy_version=version,
        finish_reason=["stop"] * num_rows,
        data_source=data_sources,
        ground_truth=ground_truth,
        student_topk_ids=topk_s,
        student_topk=student_topk,
        loss_mask=masks,
        turn_index=None if masks is None else [None if m is None else _segments(m) for m in masks],
    )
    write_rollout_shard(store, run, shard_id, table, student_topk=student_topk)
    if not annotate:
        return {"sample_ids": sample_ids, "prompts": prompts, "responses": responses}

    for name, model in teachers.items():
        if routing is None:
            rows = np.arange(num_rows)
        else:
            rows = np.array([i for i, ds in enumerate(data_sources) if routing.get(ds) == name], dtype=np.int64)
        sub_lengths = np.array([int(trained[i].sum()) for i in rows], dtype=np.int64)
        keep = np.concatenate([trained[i] for i in rows]) if len(rows) else np.zeros(0, dtype=bool)
        total = int(sub_lengths.sum())
        if model is not None and len(rows):
            lps = response_logprobs(model, [prompts[i] for i in rows], [responses[i] for i in rows])
            flat = torch.cat(lps) if lps else torch.zeros(0, vocab_size)
            top = flat.topk(top_k, dim=-1)
            ids, lp = top.indices.numpy()[keep], top.values.numpy()[keep]
            sampled = torch.from_numpy(np.concatenate([responses[i] for i in rows]).astype(np.int64))
            token_lp = flat.gather(1, sampled[:, None]).squeeze(1).numpy()[keep]
            support = None
            if student_topk:
                sup_ids = torch.from_numpy(np.concatenate([topk_s[i] for i in rows]).astype(np.int64))
                support = flat.gather(1, sup_ids).numpy()[keep]
        else:
            # distinct ids per position: a random start, then consecutive ids (mod V)
            ids = (rng.integers(0, vocab_size, size=(total, 1)) + np.arange(top_k)) % vocab_size
            lp = (
                np.sort(np.log(rng.dirichlet(np.ones(top_k + 1), size=total)[:, :top_k] + 1e-9), axis=1)[:, ::-1]
                if total
                else np.zeros((0, top_k))
            )
            token_lp = -rng.random(total).astype(np.float32) * 3
            support = -rng.random((total, student_topk)).astype(np.float32) * 3 if student_topk else None
        part = annotated_table(
            sample_ids=[sample_ids[i] for i in rows],
            lengths=sub_lengths,
            topk_ids=np.asarray(ids).reshape(total, top_k),
            topk_logprobs=np.ascontiguousarray(np.asarray(lp, dtype=np.float32).reshape(total, top_k)),
            token_logprob=np.asarray(token_lp, dtype=np.float32),
            logprob_dtype=logprob_dtype,
            support_logprobs=support,
        )
        write_annotated_part(store, run, shard_id, name, part, top_k=top_k, student_topk=student_topk)
    return {"sample_ids": sample_ids, "prompts": prompts, "responses": responses}


def _segments(mask: np.ndarray) -> np.ndarray:
    """A turn index for a synthetic mask: each run of equal mask values is one message."""
    return np.concatenate([[0], np.cumsum(mask[1:] != mask[:-1])]).astype(np.int16) if len(mask) else mask


def write_synthetic_store(store: Store, run: RunManifest, num_shards: int, **shard_options) -> list[str]:
    """Write shards 0..num_shards-1 of worker "w00" at policy version 0 (shard i seeded with i); returns their ids.

    `shard_options`: `write_synthetic_shard`'s keyword arguments (num_rows, prompt_len, ...) except seed;
    vocab_size and top_k default to the run manifest's, which the shards must agree with.
    """
    shard_options = {"vocab_size": run.vocab_size, "top_k": run.top_k} | shard_options
    shard_ids = [make_shard_id(0, "w00", seq) for seq in range(num_shards)]
    for seq, shard_id in enumerate(shard_ids):
        write_synthetic_shard(store, run, shard_id, seed=seq, **shard_options)
    return shard_ids


class CountingFileSystem:
    """A store's filesystem, counting the requests made through it: LIST, HEAD (one path's info), GET (a read),
    and the keys listed.

    A listing counts as the LIST requests an object store needs for it: one per 1,000 keys (a local
    directory lists a whole tree in one call, but its cost grows the same way).
    """

    def __init__(self, fs):
        self.fs, self.requests = fs, Counter()

    def get_file_info(self, what):
        infos = self.fs.get_file_info(what)
        if isinstance(what, pafs.FileSelector):
            self.requests["LIST"] += max(1, math.ceil(len(infos) / 1000))
            self.requests["keys"] += len(infos)
        else:
            self.requests["HEAD"] += 1
        return infos

    def open_input_stream(self, path):
        self.requests["GET"] += 1
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        self.requests["GET"] += 1
        return self.fs.open_input_file(path)

    def __getattr__(self, name):
        return getattr(self.fs, name)
