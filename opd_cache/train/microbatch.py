"""Decode a set of rows into the tensors of one micro-batch.

Layout: prompt + response of each row, right-padded to the longest row
([B, L] input ids and attention mask). The loss needs, for each response token
t of row b, the hidden state at position P_b - 1 + t (the one that predicts
it), so the batch carries those flat positions (`response_positions`, into the
[B * L] flattened hidden states) and every per-token target as a flat [N, …]
array in row order.

Multi-turn rows (schema version 2) carry every response token in the input ids (tool results and template
text are context) but only their trained tokens (loss_mask = 1) in the per-token arrays: an untrained token has
no entry, so no loss and no gradient of its own; the aggregation counts trained tokens only.

Everything is built with numpy on the flat Arrow values (one gather per column
per shard); there is no loop over rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from opd_cache.losses import aggregation_weights
from opd_cache.target_flags import SAME_TOKENIZER
from opd_cache.train.shard_data import ShardCache, offsets_of, ragged_index


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded
    attention_mask: torch.Tensor  # [B, L] int64
    response_positions: torch.Tensor  # [N] int64, index into the [B * L] hidden states
    sampled_ids: torch.Tensor  # [N] int64, the trained response tokens
    behavior_logprobs: torch.Tensor  # [N] float32
    teacher_topk_ids: torch.Tensor  # [N, k] int32 (as stored)
    teacher_topk_logprobs: torch.Tensor  # [N, k] float16 or float32 (as stored)
    teacher_token_logprobs: torch.Tensor  # [N] float32
    token_weights: torch.Tensor  # [N] float32, aggregation weights over the global batch
    support_ids: torch.Tensor | None = None  # [N, k_s] int32, the behavior policy's top-k (union support)
    support_logprobs: torch.Tensor | None = None  # [N, k_s] float32, the teacher's log-probs there
    advantages: torch.Tensor | None = None  # [N] float32, task-reward advantage of the token's row
    target_flags: torch.Tensor | None = None  # [N] uint8, cross-tokenizer parts (opd_cache/target_flags.py)
    num_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.sampled_ids.shape[0])

    def _map(self, fn) -> MicroBatch:
        return MicroBatch(
            **{f.name: fn(v) if isinstance(v := getattr(self, f.name), torch.Tensor) else v for f in fields(self)}
        )

    def to(self, device: torch.device) -> MicroBatch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> MicroBatch:
        return self._map(lambda t: t.pin_memory())


def empty_micro_batch(top_k: int, support_k: int = 0, task: bool = False) -> MicroBatch:
    """A padding micro-batch: one 1-token row and no loss token (keeps ranks' collectives in step)."""
    zeros = torch.zeros(0, dtype=torch.float32)
    return MicroBatch(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        attention_mask=torch.ones(1, 1, dtype=torch.long),
        response_positions=torch.zeros(0, dtype=torch.long),
        sampled_ids=torch.zeros(0, dtype=torch.long),
        behavior_logprobs=zeros,
        teacher_topk_ids=torch.zeros(0, top_k, dtype=torch.int32),
        teacher_topk_logprobs=torch.zeros(0, top_k),
        teacher_token_logprobs=zeros,
        token_weights=zeros,
        support_ids=torch.zeros(0, support_k, dtype=torch.int32) if support_k else None,
        support_logprobs=torch.zeros(0, support_k) if support_k else None,
        advantages=zeros if task else None,
        num_rows=0,
    )


def decode_rows(
    cache: ShardCache,
    shard_ids: list[str],
    row_shard: np.ndarray,
    row_index: np.ndarray,
    *,
    aggregation: str,
    global_tokens: int,
    global_seqs: int,
    advantages: np.ndarray | None = None,
    pad_id: int = 0,
) -> MicroBatch:
    """The micro-batch of the given rows (`row_shard` indexes `shard_ids`)."""
    order = np.lexsort((row_index, row_shard))  # group by shard; the order of rows in a micro-batch is free
    row_shard, row_index = row_shard[order], row_index[order]
    pieces: dict[str, list[np.ndarray]] = {
        k: []
        for k in (
            "prompt_len",
            "response_len",
            "trained_len",
            "trained",
            "prompt",
            "response",
            "behavior",
            "topk_ids",
            "topk_lp",
            "token_lp",
            "support_ids",
            "support_lp",
            "flags",
        )
    }
    any_flags = any(cache.get(shard_ids[int(s)]).target_flags is not None for s in np.unique(row_shard))
    for s in np.unique(row_shard):
        data = cache.get(shard_ids[int(s)])
        rows = row_index[row_shard == s]
        pieces["prompt_len"].append(data.prompt_lengths[rows])
        pieces["response_len"].append(data.response_lengths[rows])
        pieces["prompt"].append(data.prompt_values[ragged_index(data.prompt_offsets, rows)])
        pieces["trained_len"].append(data.trained_lengths[rows])
        tokens = ragged_index(data.response_offsets, rows)
        pieces["response"].append(data.response_values[tokens])
        if data.trained is not None:  # the per-token columns below: trained tokens only
            pieces["trained"].append(data.trained[tokens])
            tokens = tokens[data.trained[tokens]]
        else:
            pieces["trained"].append(np.ones(len(tokens), dtype=bool))
        pieces["behavior"].append(data.behavior_logprobs[tokens])
        teacher_rows = tokens if data.teacher_token_index is None else data.teacher_token_index[tokens]
        pieces["topk_ids"].append(data.topk_ids[teacher_rows])
        pieces["topk_lp"].append(data.topk_logprobs[teacher_rows])
        pieces["token_lp"].append(data.token_logprob[teacher_rows])
        if data.support_logprobs is not None:
            pieces["support_ids"].append(data.student_topk_ids[tokens])
            pieces["support_lp"].append(data.support_logprobs[teacher_rows])
        if any_flags:  # cross-tokenizer parts; a same-tokenizer shard among them is SAME_TOKENIZER everywhere
            flags = data.target_flags
            pieces["flags"].append(
                flags[teacher_rows] if flags is not None else np.full(len(tokens), SAME_TOKENIZER, dtype=np.uint8)
            )
    cat = {k: (v[0] if len(v) == 1 else np.concatenate(v)) if v else None for k, v in pieces.items()}

    prompt_len, response_len = cat["prompt_len"], cat["response_len"]
    n_rows = len(prompt_len)
    seq_len = prompt_len + response_len
    width = max(int(seq_len.max()), 1)
    input_ids = np.full((n_rows, width), pad_id, dtype=np.int64)
    row_of_prompt = np.repeat(np.arange(n_rows), prompt_len)
    col_of_prompt = np.arange(len(row_of_prompt)) - np.repeat(offsets_of(prompt_len)[:-1], prompt_len)
    input_ids[row_of_prompt, col_of_prompt] = cat["prompt"]
    row_of_token = np.repeat(np.arange(n_rows), response_len)
    col_of_token = (
        np.arange(len(row_of_token)) - np.repeat(offsets_of(response_len)[:-1], response_len) + prompt_len[row_of_token]
    )
    input_ids[row_of_token, col_of_token] = cat["response"]
    attention_mask = (np.arange(width)[None, :] < seq_len[:, None]).astype(np.int64)
    trained, trained_len = cat["trained"], cat["trained_len"]
    positions = row_of_token * width + col_of_token - 1
    response = cat["response"]
    if not trained.all():
        positions, response = positions[trained], response[trained]

    # Aggregation weights of the whole optimizer step (global token / sequence counts), over trained tokens.
    mask = torch.from_numpy(np.arange(max(int(trained_len.max()), 1))[None, :] < trained_len[:, None])
    weights = aggregation_weights(
        mask, aggregation, global_tokens=max(global_tokens, 1), global_seqs=max(global_seqs, 1)
    )[mask]

    support = cat["support_ids"] is not None
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        response_positions=torch.from_numpy(positions),
        sampled_ids=torch.from_numpy(response.astype(np.int64)),
        behavior_logprobs=torch.from_numpy(cat["behavior"]),
        # top-k columns keep their stored dtypes (int32 ids, float16/32 log-probs): half the bytes to copy
        # and to move to the GPU; the loss converts them on the device
        teacher_topk_ids=torch.from_numpy(cat["topk_ids"]),
        teacher_topk_logprobs=torch.from_numpy(cat["topk_lp"]),
        teacher_token_logprobs=torch.from_numpy(cat["token_lp"]),
        token_weights=weights.to(torch.float32),
        support_ids=torch.from_numpy(cat["support_ids"]) if support else None,
        support_logprobs=torch.from_numpy(cat["support_lp"]) if support else None,
        advantages=(
            torch.from_numpy(np.repeat(advantages[order], trained_len).astype(np.float32))
            if advantages is not None
            else None
        ),
        target_flags=torch.from_numpy(cat["flags"]) if cat["flags"] is not None else None,
        num_rows=n_rows,
    )
