"""Top-k divergences: generalized KL and JSD between p and q seen through the support S.

Three tail handlings choose the buckets (docs/losses.md, "Top-k divergences"):
  bucket: S plus one tail bucket "everything outside S" (exact, >= 0, a lower
          bound of the full-vocabulary divergence, equal to it when S covers
          the vocabulary);
  renorm: p and q both renormalised over S;
  none:   verl's `forward_kl_topk`, sum_S p (log p - log q) with the
          full-vocabulary log q, clamped at 0 (forward KL only, kept for parity).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from opd_cache.losses.config import LossConfig
from opd_cache.losses.targets import _Targets
from opd_cache.losses.vocab import _VocabStats

# The teacher's tail mass 1 - sum(p_S) is clamped here: it is a difference of
# numbers near 1 and can round to zero or below (float16/float32 log-probs).
P_TAIL_MIN = 1e-12


def _generalized_kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """Elementwise a*log(a/b) - a + b from log a and log b; >= 0 in floating point.

    Summed over buckets where sum(a) == sum(b) it is KL(a || b); the extra
    "- a + b" makes every term non-negative, so the sum is >= 0 without any
    clamp. With x = log(b/a) the term is a * psi(x), psi(x) = e^x - 1 - x:
      |x| < 1e-2: a power series with a positive factor (no cancellation),
      x <= 1:     expm1(x) - x, whose true value exceeds the rounding error,
      x > 1:      b - a*(1 + x) >= 0.26*b, which avoids overflowing e^x.
    a == 0 gives b (the limit).
    """
    a_is_zero = log_a == -math.inf
    log_a = torch.where(a_is_zero, 0.0, log_a)
    a = log_a.exp()
    x = log_b - log_a
    small = x.abs() < 1e-2
    large = x > 1.0
    middle = ~small & ~large
    xs = torch.where(small, x, 0.0)
    series = xs * xs * (0.5 + xs * (1.0 / 6.0 + xs * (1.0 / 24.0 + xs / 120.0)))
    xm = torch.where(middle, x, 0.5)
    mid = torch.expm1(xm) - xm
    xl = torch.where(large, x, 2.0)
    b_large = torch.where(large, log_b, log_a + 2.0).exp()
    big = b_large - a * (1.0 + xl)
    term = torch.where(small, a * series, torch.where(middle, a * mid, big))
    return torch.where(a_is_zero, log_b.exp(), term)


def _divergence_over_buckets(log_p: Tensor, log_q: Tensor, valid: Tensor, config: LossConfig) -> Tensor:
    """Divergence between two distributions given as log-masses on buckets [n, B].

    `valid` marks the buckets that exist (duplicates and an empty tail do not).
    """
    # Invalid buckets get finite placeholders so no NaN reaches the gradient.
    log_p = torch.where(valid, log_p, 0.0)
    log_q = torch.where(valid, log_q, 0.0)
    d, beta = config.divergence, config.beta
    if d == "forward_kl" or (d == "jsd" and beta == 0.0):
        terms = _generalized_kl(log_p, log_q)
    elif d == "reverse_kl" or (d == "jsd" and beta == 1.0):
        terms = _generalized_kl(log_q, log_p)
    else:  # generalized JSD, 0 < beta < 1
        log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
        terms = beta * _generalized_kl(log_p, log_m) + (1.0 - beta) * _generalized_kl(log_q, log_m)
    return torch.where(valid, terms, 0.0).sum(-1)


def _teacher_tail_logmass(targets: _Targets) -> Tensor:
    """log p_tail, p_tail = 1 - sum_S p clamped at P_TAIL_MIN (summed in float64)."""
    p_support = targets.support_logprobs.double().exp() * targets.keep
    p_tail = (1.0 - p_support.sum(1)).clamp_min(P_TAIL_MIN)
    return p_tail.log().to(targets.support_logprobs.dtype)


def _masked_logsumexp(x: Tensor, keep: Tensor) -> Tensor:
    return torch.logsumexp(x.masked_fill(~keep, -math.inf), 1, keepdim=True)


def topk_divergence(stats: _VocabStats, targets: _Targets, config: LossConfig) -> Tensor:
    """Per-token loss [n] of a "topk" divergence, differentiable w.r.t. the fields of `stats`."""
    keep = targets.keep
    log_q_support = stats.z_support - stats.lse[:, None]
    if config.tail == "none":  # verl's forward_kl_topk
        p = targets.support_logprobs.exp()
        terms = p * (targets.support_logprobs - log_q_support)
        return torch.where(keep, terms, 0.0).sum(1).clamp_min(0.0)
    if config.tail == "renorm":  # both renormalised over S (student from its logits at S)
        log_p = targets.support_logprobs - _masked_logsumexp(targets.support_logprobs, keep)
        log_q = stats.z_support - _masked_logsumexp(stats.z_support, keep)
        return _divergence_over_buckets(log_p, log_q, keep, config)
    # bucket: S plus one tail bucket
    log_q_tail = stats.lse_tail - stats.lse
    log_p = torch.cat([targets.support_logprobs, _teacher_tail_logmass(targets)[:, None]], 1)
    log_q = torch.cat([log_q_support, log_q_tail[:, None]], 1)
    valid = torch.cat([keep, targets.has_tail[:, None]], 1)
    return _divergence_over_buckets(log_p, log_q, valid, config)
