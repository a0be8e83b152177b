"""Losses of the sampled token: the k1/k2/k3/abs estimators and policy-gradient OPD.

s is the student's log-prob of the sampled token (with gradient), t the
teacher's. k2, k3 and abs are direct losses; k1 = s - t is only valid as the
(negative) reward of policy-gradient OPD (`pg_loss`, or `LossConfig(divergence="pg")`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from opd_cache.losses.config import LossConfig, check_clip_range
from opd_cache.losses.targets import _Targets
from opd_cache.losses.vocab import _VocabStats


def _sampled_estimator(s: Tensor, t: Tensor, name: str) -> Tensor:
    """Estimators of KL(q || p) from the sampled token (s, t: student, teacher log-probs)."""
    if name == "k1":
        return s - t
    if name == "abs":
        return (s - t).abs()
    if name == "k2":
        return 0.5 * (s - t).square()
    # k3, with verl's clamps (`kl_penalty(..., "low_var_kl")`)
    log_ratio = (t - s).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def pg_loss(
    student_logprobs: Tensor,
    behavior_logprobs: Tensor,
    teacher_token_logprobs: Tensor,
    clip_low: float = LossConfig.clip_low,
    clip_high: float = LossConfig.clip_high,
    importance_cap: float | None = None,
    proximal_logprobs: Tensor | None = None,
) -> Tensor:
    """Per-token loss of policy-gradient OPD (PPO-clipped), shape of `student_logprobs`.

    reward   r = sg(t - s_behavior)                (the negative k1 at the behavior policy)
    ratio      = exp(s - s_prox)
    loss       = w * max(-r * ratio, -r * clip(ratio, 1 - clip_low, 1 + clip_high))
    weight   w = sg(min(exp(s_prox - s_behavior), importance_cap))   (1 when importance_cap is None)

    s_prox (the proximal policy of decoupled PPO) defaults to s_behavior without
    `importance_cap` (classic PPO-clip against the sampling policy) and to sg(s) with
    `importance_cap`: one update per batch, the truncated importance weight
    min(exp(s - s_behavior), c) corrects stale rows. Pass `proximal_logprobs`
    (log-probs of the parameters at the start of the step) for several updates.
    The clip range defaults to LossConfig's (0.2, 0.28).
    """
    check_clip_range(clip_low, clip_high)
    if importance_cap is not None and not importance_cap > 0.0:
        raise ValueError(f"importance_cap={importance_cap} must be > 0 (or None for no importance weight)")
    for name, x in (("behavior_logprobs", behavior_logprobs), ("teacher_token_logprobs", teacher_token_logprobs)):
        if x.shape != student_logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(student_logprobs.shape)}")
    s = student_logprobs
    s_b = behavior_logprobs.to(s.dtype).detach()
    reward = (teacher_token_logprobs.to(s.dtype) - s_b).detach()
    if proximal_logprobs is not None:
        s_prox = proximal_logprobs.to(s.dtype).detach()
    else:
        s_prox = s_b if importance_cap is None else s.detach()
    ratio = torch.exp(s - s_prox)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(-reward * ratio, -reward * clipped)
    if importance_cap is not None:
        loss = loss * torch.exp(s_prox - s_b).clamp(max=importance_cap).detach()
    return loss


def sampled_token_loss(stats: _VocabStats, targets: _Targets, config: LossConfig) -> Tensor:
    """Per-token loss [n] of a "sampled" divergence, differentiable w.r.t. the fields of `stats`."""
    s = stats.z_sampled - stats.lse
    if config.policy_gradient:
        return pg_loss(
            s, targets.behavior, targets.teacher_token, config.clip_low, config.clip_high, config.importance_cap
        )
    return _sampled_estimator(s, targets.teacher_token, config.divergence)
