"""Diagnostics of either path (`return_diagnostics=True`): per-token values, then means.

`_diagnostic_parts` computes per-token values [n] from the reductions (no
gradient); the fused path concatenates them over its chunks (`_concat_parts`);
`_diagnostics` reduces them over the selected tokens to 0-d tensors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from opd_cache.losses.targets import _Targets
from opd_cache.losses.vocab import _VocabStats


def _diagnostic_parts(
    stats: _VocabStats, targets: _Targets, per_token: Tensor, student_topk_ids: Tensor | None
) -> dict[str, Tensor]:
    """Per-token diagnostic values [n] (no gradient)."""
    parts = {"loss": per_token}
    if targets.support.shape[1]:
        keep = targets.keep
        teacher_mass = (targets.support_logprobs.double().exp() * keep).sum(1)
        parts["teacher_mass_support"] = teacher_mass.to(per_token.dtype)
        parts["teacher_tail_mass"] = (1.0 - teacher_mass).clamp_min(0.0).to(per_token.dtype)
        parts["student_mass_support"] = (torch.exp(stats.z_support - stats.lse[:, None]) * keep).sum(1)
        parts["student_tail_mass"] = torch.exp(stats.lse_tail - stats.lse)
    if student_topk_ids is not None and targets.topk:
        teacher_topk = targets.support[:, : targets.topk]
        shared = (teacher_topk[:, :, None] == student_topk_ids[:, None, :]).any(2)
        parts["topk_overlap"] = shared.sum(1).to(per_token.dtype) / targets.topk
    if targets.teacher_token is not None:
        parts["k1"] = (stats.z_sampled - stats.lse) - targets.teacher_token
    return parts


def _concat_parts(parts: list[dict[str, Tensor]], per_token: Tensor) -> dict[str, Tensor]:
    if not parts:
        return {"loss": per_token}
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _diagnostics(parts: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """Means over the selected tokens, plus loss min/max and the token count (0-d tensors).

    Keys: tokens, loss_mean, loss_min, loss_max, and when the inputs allow them
    teacher_mass_support, student_mass_support, teacher_tail_mass,
    student_tail_mass (masses of S and of the tail), topk_overlap (share of the
    teacher's top-k ids that are among the student's top-k), k1 (mean s - t,
    the sampled-token estimate of KL(q || p)). NaN when no token is selected.
    """
    loss = parts["loss"][rows]
    nan = torch.tensor(math.nan, dtype=parts["loss"].dtype, device=rows.device)
    out = {
        "tokens": rows.sum(),
        "loss_mean": loss.mean() if loss.numel() else nan,
        "loss_min": loss.min() if loss.numel() else nan,
        "loss_max": loss.max() if loss.numel() else nan,
    }
    for key, values in parts.items():
        if key != "loss":
            selected = values[rows]
            out[key] = selected.mean() if selected.numel() else nan
    return out
