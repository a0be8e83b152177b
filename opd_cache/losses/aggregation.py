"""Aggregation over tokens, sequences, micro-batches and ranks.

`aggregation_weights` turns a response mask into per-token weights whose sum
with the per-token losses is the step's loss; with the global token and
sequence counts of the optimizer step, summing the micro-batch losses (and
all-reducing gradients with SUM over ranks) gives the full-batch gradient exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from opd_cache.losses.config import AGGREGATIONS


def aggregation_weights(
    mask: Tensor,
    mode: str = "token-mean",
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
) -> Tensor:
    """Weights w (shape of `mask`) with aggregate(per_token, mask, mode) = sum(w * per_token).

    token-mean:          mask / global_tokens (the response tokens of the whole
                         optimizer step: all micro-batches and ranks)
    seq-mean-token-mean: mask / (tokens in the sequence) / global_seqs
    seq-mean-token-sum:  mask / global_seqs
    Without the global counts the local ones are used (one micro-batch, one
    rank). With them, summing the losses of all micro-batches (and all-reducing
    gradients with SUM over ranks) gives the full-batch gradient exactly.
    Sequences with no response token count neither as tokens nor as sequences.
    Pass the flattened weights to `fused_token_losses(token_weights=...)`.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {list(AGGREGATIONS)}")
    mask = mask.to(torch.float32)
    if mode == "token-mean":
        local = mask.sum()
        denom = local if global_tokens is None else torch.as_tensor(global_tokens, device=mask.device).float()
        if global_tokens is not None and bool(denom < local):
            raise ValueError(
                f"global_tokens={float(denom):g} is smaller than the {int(local)} tokens in this micro-batch; "
                "pass the response-token count of the whole optimizer step"
            )
        return mask / denom.clamp_min(1.0)
    if mask.dim() != 2:
        raise ValueError(f"mode={mode!r} needs a [sequences, tokens] mask, got shape {tuple(mask.shape)}")
    lengths = mask.sum(1)
    local = (lengths > 0).sum().to(torch.float32)
    denom = local if global_seqs is None else torch.as_tensor(global_seqs, device=mask.device).float()
    if global_seqs is not None and bool(denom < local):
        raise ValueError(
            f"global_seqs={float(denom):g} is smaller than the {int(local)} sequences in this micro-batch; "
            "pass the sequence count of the whole optimizer step"
        )
    weights = mask / denom.clamp_min(1.0)
    if mode == "seq-mean-token-mean":
        weights = weights / lengths.clamp_min(1.0)[:, None]
    return weights


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
) -> Tensor:
    """Scalar loss from per-token losses and a 0/1 mask of the same shape (see `aggregation_weights`)."""
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token has shape {tuple(per_token.shape)} but mask has {tuple(mask.shape)}")
    weights = aggregation_weights(mask, mode, global_tokens, global_seqs).to(per_token.dtype)
    return torch.where(mask.bool(), per_token * weights, 0.0).sum()
