"""Vocabulary reductions: the only code that touches [tokens, vocab].

Every loss is a function of four per-token reductions of the logits z
(`_VocabStats`): the full log-sum-exp, z at the support S, the log-sum-exp
over the complement of S, and z at the sampled token. `_reduce_vocab`
computes them keeping one [n, V] buffer, and `_vocab_grad_` turns that buffer
into the gradient w.r.t. z in place (the hand-written chain rule both paths
share). `_VocabReduction` wraps the two as an autograd op on materialised
logits; the fused path calls them directly, chunk by chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from opd_cache.losses.targets import _Targets


@dataclass
class _VocabStats:
    """Per-token reductions of the logits z; every loss is a function of these."""

    lse: Tensor  # [n] logsumexp(z): log of the normaliser of q
    z_support: Tensor  # [n, K] z at the support ids
    lse_tail: Tensor  # [n] logsumexp of z outside S (-inf when S covers the vocabulary)
    z_sampled: Tensor  # [n] z at the sampled token

    def detach(self) -> _VocabStats:
        return _VocabStats(self.lse.detach(), self.z_support.detach(), self.lse_tail.detach(), self.z_sampled.detach())


def _reduce_vocab(z: Tensor, targets: _Targets, overwrite: bool, student_topk: int = 0):
    """Reduce logits [n, V] to `_VocabStats`, keeping one [n, V] buffer for the gradient.

    The returned buffer holds exp(z - m) outside S and 0 on S, with m the max of
    z outside S; `_vocab_grad_` turns it into the gradient w.r.t. z in place.
    With `overwrite`, that buffer is `z` itself (the fused path: no extra
    [n, V] allocation). log q_tail is a log-sum-exp over the complement with
    its own max, exact even when sum(q_S) rounds to 1.
    """
    z_support = z.gather(1, targets.support)
    z_sampled = z.gather(1, targets.sampled[:, None]).squeeze(1)
    topk_ids = z.topk(student_topk, dim=1).indices if student_topk else None
    buf = z if overwrite else z.clone()
    buf.scatter_(1, targets.support, -math.inf)
    m = buf.amax(1)
    m = torch.where(torch.isfinite(m), m, 0.0)  # -inf when the complement is empty
    buf.sub_(m[:, None]).exp_()
    sum_tail = buf.sum(1)  # >= 1 when the complement is not empty
    lse_tail = m + sum_tail.log()
    lse_support = torch.logsumexp(z_support.masked_fill(~targets.keep, -math.inf), 1)
    lse = torch.logaddexp(lse_tail, lse_support)
    return _VocabStats(lse, z_support, lse_tail, z_sampled), buf, (m, sum_tail), topk_ids


def _vocab_grad_(
    buf: Tensor,
    aux: tuple[Tensor, Tensor],
    stats: _VocabStats,
    targets: _Targets,
    g_lse: Tensor | None,
    g_support: Tensor | None,
    g_tail: Tensor | None,
    g_sampled: Tensor | None,
) -> Tensor:
    """Chain rule from the reductions to the logits, written into `buf` [n, V].

    d lse/dz = q; d lse_tail/dz = softmax of z over the complement (0 on S);
    d z_support/dz and d z_sampled/dz are one-hots. Outside S,
    q_j = buf_j * exp(m - lse) and r_j = buf_j / sum_tail.
    """
    m, sum_tail = aux
    nonempty = sum_tail > 0
    coef = torch.zeros_like(m)
    g_on_support = torch.zeros_like(stats.z_support) if g_support is None else g_support.clone()
    if g_lse is not None:
        coef = coef + g_lse * torch.where(nonempty, torch.exp(m - stats.lse), 0.0)
        q_support = torch.exp(stats.z_support - stats.lse[:, None]) * targets.keep
        g_on_support = g_on_support + g_lse[:, None] * q_support
    if g_tail is not None:
        coef = coef + g_tail * torch.where(nonempty, 1.0 / sum_tail, 0.0)
    buf.mul_(coef[:, None])
    buf.scatter_add_(1, targets.support, g_on_support)
    if g_sampled is not None:
        buf.scatter_add_(1, targets.sampled[:, None], g_sampled[:, None])
    return buf


class _VocabReduction(torch.autograd.Function):
    """`_reduce_vocab` as a differentiable op on materialised logits."""

    @staticmethod
    def forward(ctx, z: Tensor, targets: _Targets):
        stats, buf, aux, _ = _reduce_vocab(z, targets, overwrite=False)
        ctx.targets = targets
        ctx.save_for_backward(buf, *aux, stats.lse, stats.z_support)
        ctx.set_materialize_grads(False)
        return stats.lse, stats.z_support, stats.lse_tail, stats.z_sampled

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lse, g_support, g_tail, g_sampled):
        buf, m, sum_tail, lse, z_support = ctx.saved_tensors
        stats = _VocabStats(lse, z_support, lse, lse)  # only lse and z_support are read
        # The clone keeps the saved buffer intact for backward(retain_graph=True).
        grad = _vocab_grad_(buf.clone(), (m, sum_tail), stats, ctx.targets, g_lse, g_support, g_tail, g_sampled)
        return grad, None
