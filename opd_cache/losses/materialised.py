"""`token_losses`: the per-token loss on materialised logits [N, V] (the reference path).

`_per_token` (the loss from the four vocabulary reductions) is shared with the
fused path, so both compute the same numbers and differentiate through the
same chain rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

from opd_cache.losses.config import LossConfig
from opd_cache.losses.diagnostics import _diagnostic_parts, _diagnostics
from opd_cache.losses.divergences import topk_divergence
from opd_cache.losses.estimators import sampled_token_loss
from opd_cache.losses.targets import _check_config, _check_student_logits, _check_targets, _Targets
from opd_cache.losses.vocab import _VocabReduction, _VocabStats


def _per_token(stats: _VocabStats, targets: _Targets, config: LossConfig) -> Tensor:
    """Per-token loss [n], differentiable w.r.t. the fields of `stats`."""
    if config.kind == "sampled":
        return sampled_token_loss(stats, targets, config)
    return topk_divergence(stats, targets, config)


def token_losses(
    student_logits: Tensor,
    teacher_topk_ids: Tensor | None = None,
    teacher_topk_logprobs: Tensor | None = None,
    config: LossConfig = LossConfig(),
    *,
    sampled_ids: Tensor | None = None,
    teacher_token_logprobs: Tensor | None = None,
    support_ids: Tensor | None = None,
    support_teacher_logprobs: Tensor | None = None,
    behavior_logprobs: Tensor | None = None,
    return_diagnostics: bool = False,
):
    """Per-token distillation loss [N] from student logits [N, V], with the options of `config`.

    Differentiable w.r.t. `student_logits` only; computed in float32 (float64
    for float64 logits). `teacher_topk_ids/logprobs` ([N, k], full-vocabulary
    log-probs) are needed by the top-k divergences; `sampled_ids` and
    `teacher_token_logprobs` ([N]) by k1/k2/k3/abs; `behavior_logprobs` by
    policy-gradient OPD (divergence "pg", see `pg_loss`). `support_ids` with
    `support_teacher_logprobs` ([N, k_s]) extend S (union support; an id in
    both counts once). With `return_diagnostics=True` returns
    (per_token, diagnostics) — see `diagnostics._diagnostics`.
    """
    config = _check_config(config)
    n, vocab, dtype = _check_student_logits(student_logits)
    targets = _check_targets(
        config, n, vocab, student_logits.device, dtype,
        teacher_topk_ids, teacher_topk_logprobs, sampled_ids, teacher_token_logprobs,
        support_ids, support_teacher_logprobs, behavior_logprobs,
    )  # fmt: skip
    z = student_logits.to(dtype)
    stats = _VocabStats(*_VocabReduction.apply(z, targets))
    per_token = _per_token(stats, targets, config)
    if not return_diagnostics:
        return per_token
    with torch.no_grad():
        topk_ids = z.topk(targets.topk, dim=1).indices if targets.topk else None
        parts = _diagnostic_parts(stats.detach(), targets, per_token.detach(), topk_ids)
    return per_token, _diagnostics(parts, torch.ones(n, dtype=torch.bool, device=z.device))
