"""Losses on cross-tokenizer targets: the top-k term where it applies, a span term on aligned groups elsewhere.

A teacher of another tokenizer is aligned to the student's tokens in groups (docs/cross-tokenizer.md), and its
parts carry per position `target_flags` (opd_cache/target_flags.py), the top-k in student ids (valid where
TOPK_VALID) and, at each group's last position (GROUP_END), the teacher's log-prob of the whole group. The
loss is GOLD's hybrid on those cached targets:

    per_token[i] = [i TOPK_VALID] * D_topk(i)                               the configured top-k divergence
                 + weight * [i ends a span group] * f(s_g, t_g)             a sampled-token estimator on the group

with s_g = sum of the student's log-probs of the group's sampled tokens (with gradient), t_g the teacher's
group log-prob, f the span estimator (`SpanTermConfig`). A *span group* is a group that is not a single
TOPK_VALID position: there the top-k term already says everything. With a sampled-token divergence
(k2/k3/abs, or "pg"), f is that divergence on every group and there is no top-k term.

Same-tokenizer targets (every position TOPK_VALID and GROUP_END) have no span group, and a sampled-token
divergence then sees one-token groups with s_g = s: both paths give today's `token_losses` /
`fused_token_losses` bit for bit (tests/test_cross_tokenizer_losses.py).

The group term sits at the group's last position and is weighted by that position's token weight: a group
counts once, as one term of the sequence's KL (its tokens' conditional KLs add up to it). Positions of an
EXCLUDED row get no term and no gradient.

Why k2 is the default span estimator: on the student's own samples the gradient of k2 = (s - t)^2 / 2 is
E[(s - t) grad s] = grad KL(q || p), the reverse-KL gradient over group events, at any distance from the
teacher; k3's clamp (verl's) zeroes the gradient exactly where the student is far more confident than the
teacher (t - s < -11), which is where a group is most wrong.

The fused path is `fused_token_losses`'s loop (fused.py) with two differences: chunks end at group ends, so
a group's sum never straddles two chunks, and the per-token function is the hybrid above.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from opd_cache.losses.config import LossConfig
from opd_cache.losses.diagnostics import _diagnostic_parts, _diagnostics
from opd_cache.losses.divergences import topk_divergence
from opd_cache.losses.estimators import _sampled_estimator, pg_loss
from opd_cache.losses.fused import (
    _check_hidden_and_head,
    _chunked_forward,
    _fused_chunk,
    _scaled_grads,
    _weights_and_grad_needs,
)
from opd_cache.losses.targets import _check_config, _check_student_logits, _check_targets, _Targets
from opd_cache.losses.vocab import _VocabReduction, _VocabStats
from opd_cache.target_flags import ALL_FLAGS, EXCLUDED, GROUP_END, TOPK_VALID

SPAN_ESTIMATORS = ("k2", "k3", "abs")
# Diagnostics read at TOPK_VALID positions only (elsewhere the top-k columns hold placeholders).
_TOPK_KEYS = ("teacher_mass_support", "student_mass_support", "teacher_tail_mass", "student_tail_mass", "topk_overlap")


@dataclass(frozen=True)
class SpanTermConfig:
    """The span term of a top-k divergence: its estimator on groups and its weight against the top-k term."""

    weight: float = 1.0
    estimator: str = "k2"

    def __post_init__(self):
        if self.estimator not in SPAN_ESTIMATORS:
            raise ValueError(f"span estimator {self.estimator!r}: expected one of {list(SPAN_ESTIMATORS)}")
        if not self.weight >= 0.0:
            raise ValueError(f"span weight {self.weight} must be >= 0")


@dataclass
class _Groups:
    """The group structure of N positions, read from their target flags."""

    group_of: Tensor  # [n] int64: the group of each position, numbered from 0 within these positions
    num_groups: int
    topk: Tensor  # [n] bool: TOPK_VALID (the top-k term applies with a top-k divergence)
    end: Tensor  # [n] bool: a group ends here (not in an excluded row)
    span: Tensor  # [n] bool: a span term sits here

    def rows(self, start: int, end: int) -> _Groups:
        """Positions [start, end), which must start a group (chunks end at group boundaries)."""
        group_of = self.group_of[start:end]
        first = int(group_of[0]) if end > start else 0
        last = int(group_of[-1]) + 1 if end > start else first
        return _Groups(group_of - first, last - first, self.topk[start:end], self.end[start:end], self.span[start:end])


def _check_flags(target_flags: Tensor, n: int, device: torch.device) -> Tensor:
    if target_flags.dtype.is_floating_point or target_flags.dtype == torch.bool or target_flags.is_complex():
        raise ValueError(f"target_flags must hold integer flags, got dtype {target_flags.dtype}")
    if tuple(target_flags.shape) != (n,):
        raise ValueError(f"target_flags has shape {tuple(target_flags.shape)}, expected ({n},)")
    flags = target_flags.to(device=device, dtype=torch.int64)
    if n and (int(flags.min()) < 0 or int(flags.max()) > ALL_FLAGS):
        raise ValueError(
            f"target_flags has values outside [0, {ALL_FLAGS}]: min {int(flags.min())}, max {int(flags.max())}"
        )
    return flags


def _groups(flags: Tensor, config: LossConfig) -> _Groups:
    excluded = (flags & EXCLUDED) != 0
    end = ((flags & GROUP_END) != 0) & ~excluded
    boundary = end | excluded
    if len(flags) and not bool(boundary[-1]):
        raise ValueError("target_flags: the last position ends no group (GROUP_END or EXCLUDED expected there)")
    closes = boundary.long()
    group_of = torch.cumsum(closes, 0) - closes  # the number of boundaries before each position
    num_groups = int(closes.sum())
    topk = ((flags & TOPK_VALID) != 0) & ~excluded  # read by a sampled-token divergence's diagnostics only
    if config.kind != "topk":
        return _Groups(group_of, num_groups, topk, end, end)
    size = torch.bincount(group_of, minlength=num_groups)
    covered_by_topk = end & topk & (size[group_of] == 1)  # a one-position group with a top-k target
    return _Groups(group_of, num_groups, topk, end, end & ~covered_by_topk)


def _group_sums(x: Tensor, groups: _Groups) -> Tensor:
    """[n] -> [n]: the sum of x over each position's group (exact for one-position groups: 0 + x = x)."""
    return x.new_zeros(groups.num_groups).index_add(0, groups.group_of, x)[groups.group_of]


def _per_token(stats: _VocabStats, targets: _Targets, groups: _Groups, config: LossConfig, span: SpanTermConfig):
    """Per-token loss [n] of the hybrid, differentiable w.r.t. the fields of `stats`."""
    per_token = None
    if config.kind == "topk" and bool(groups.topk.any()):
        per_token = torch.where(groups.topk, topk_divergence(stats, targets, config), 0.0)
    if bool(groups.span.any()):
        s_group = _group_sums(stats.z_sampled - stats.lse, groups)
        t_group = targets.teacher_token  # the group log-prob at group ends (other positions are not read)
        if config.policy_gradient:
            behavior = _group_sums(targets.behavior, groups)
            value = pg_loss(s_group, behavior, t_group, config.clip_low, config.clip_high, config.importance_cap)
        elif config.kind == "sampled":
            value = _sampled_estimator(s_group, t_group, config.divergence)
        else:
            value = span.weight * _sampled_estimator(s_group, t_group, span.estimator)
        span_term = torch.where(groups.span, value, 0.0)
        per_token = span_term if per_token is None else per_token + span_term
    if per_token is None:  # nothing applies (an excluded row): zero, still connected to the reductions
        per_token = stats.lse * 0.0
    return per_token


def _diagnostic_values(stats, targets, groups, per_token, student_topk_ids) -> dict[str, Tensor]:
    """Per-position diagnostic values: the top-k family's, and k1 on groups (s_g - t_g at group ends)."""
    parts = _diagnostic_parts(stats, targets, per_token, student_topk_ids)
    parts.pop("k1", None)
    parts["k1"] = _group_sums(stats.z_sampled - stats.lse, groups) - targets.teacher_token
    return parts


def _reduce_diagnostics(parts: dict[str, Tensor], groups: _Groups, rows: Tensor) -> dict[str, Tensor]:
    """Means as `diagnostics._diagnostics`, each over the positions it is defined at, plus two counts."""
    out = _diagnostics({"loss": parts["loss"]}, rows)
    topk_rows = rows & groups.topk
    topk_parts = {key: parts[key] for key in _TOPK_KEYS if key in parts}
    out.update(
        {
            key: value
            for key, value in _diagnostics(dict(topk_parts, loss=parts["loss"]), topk_rows).items()
            if key in topk_parts
        }
    )
    out["k1"] = _diagnostics({"loss": parts["loss"], "k1": parts["k1"]}, rows & groups.end)["k1"]
    out["topk_share"] = topk_rows.sum() / rows.sum().clamp_min(1)
    out["span_groups"] = (rows & groups.span).sum()
    return out


def _check_inputs(
    config, n, vocab, device, dtype, flags, topk_ids, topk_logprobs, sampled_ids, teacher_token, behavior
):
    config = _check_config(config)
    if sampled_ids is None or teacher_token is None:
        raise ValueError(
            "cross-tokenizer losses need sampled_ids and teacher_token_logprobs ([N]: the group log-prob at each "
            "group's last position)"
        )
    targets = _check_targets(
        config, n, vocab, device, dtype, topk_ids, topk_logprobs, sampled_ids, teacher_token, None, None, behavior
    )
    return config, targets, _groups(_check_flags(flags, n, device), config)


def cross_tokenizer_token_losses(
    student_logits: Tensor,
    teacher_topk_ids: Tensor | None = None,
    teacher_topk_logprobs: Tensor | None = None,
    config: LossConfig = LossConfig(),
    *,
    target_flags: Tensor,
    sampled_ids: Tensor,
    teacher_token_logprobs: Tensor,
    behavior_logprobs: Tensor | None = None,
    span: SpanTermConfig = SpanTermConfig(),
    return_diagnostics: bool = False,
):
    """Per-token hybrid loss [N] from student logits [N, V] (the reference path; see the module docstring).

    The arguments are `token_losses`'s, plus `target_flags` ([N] integer flags) and `span`; the union support
    (`support_ids`) is not available across tokenizers. With `return_diagnostics=True` returns (per_token,
    diagnostics): `token_losses`'s keys (the top-k ones over TOPK_VALID positions, k1 over groups) plus
    `topk_share` and `span_groups`.
    """
    n, vocab, dtype = _check_student_logits(student_logits)
    config, targets, groups = _check_inputs(
        config, n, vocab, student_logits.device, dtype, target_flags,
        teacher_topk_ids, teacher_topk_logprobs, sampled_ids, teacher_token_logprobs, behavior_logprobs,
    )  # fmt: skip
    z = student_logits.to(dtype)
    stats = _VocabStats(*_VocabReduction.apply(z, targets))
    per_token = _per_token(stats, targets, groups, config, span)
    if not return_diagnostics:
        return per_token
    with torch.no_grad():
        topk_ids = z.topk(targets.topk, dim=1).indices if targets.topk else None
        parts = _diagnostic_values(stats.detach(), targets, groups, per_token.detach(), topk_ids)
    return per_token, _reduce_diagnostics(parts, groups, torch.ones(n, dtype=torch.bool, device=z.device))


def _boundary_ends(groups: _Groups) -> list[int]:
    """The position after each group's last position, ascending."""
    group_of = groups.group_of
    last = torch.ones_like(group_of, dtype=torch.bool)
    last[:-1] = group_of[1:] != group_of[:-1]
    return (torch.nonzero(last).flatten() + 1).tolist()


def _chunk_bounds(boundary_ends: list[int], n: int, chunk_size: int) -> list[tuple[int, int]]:
    """Chunks of at most `chunk_size` positions that end at group boundaries (a longer group gets its own)."""
    bounds, start = [], 0
    while start < n:
        i = bisect.bisect_right(boundary_ends, start + chunk_size) - 1
        end = (
            boundary_ends[i]
            if i >= 0 and boundary_ends[i] > start
            else boundary_ends[bisect.bisect_right(boundary_ends, start)]
        )
        bounds.append((start, end))
        start = end
    return bounds


class _FusedCrossTokenizerLosses(torch.autograd.Function):
    """`fused._FusedTokenLosses` over chunks that end at group boundaries, with the hybrid per-token loss."""

    @staticmethod
    def forward(ctx, hidden, weight, token_weights, targets, groups, config, span, need_hidden, need_weight, diag_out):
        def chunk(start: int, end: int, h: Tensor, w: Tensor):
            t, g = targets.rows(start, end), groups.rows(start, end)

            def per_token(stats: _VocabStats) -> Tensor:
                return _per_token(stats, t, g, config, span)

            def diagnostic_parts(stats: _VocabStats, losses: Tensor, topk_ids: Tensor | None) -> dict:
                return _diagnostic_values(stats, t, g, losses, topk_ids)

            want_diag = diagnostic_parts if diag_out is not None else None
            return _fused_chunk(h, w, t, token_weights[start:end], per_token, want_diag, need_hidden or need_weight)

        n = hidden.shape[0]
        bounds = _chunk_bounds(_boundary_ends(groups), n, config.chunk_size)
        loss, per_token, parts = _chunked_forward(
            ctx, hidden, weight, token_weights, bounds, chunk, need_hidden, need_weight
        )
        if diag_out is not None:
            values = {key: torch.cat([p[key] for p in parts]) for key in parts[0]} if parts else {"loss": per_token}
            values.setdefault("k1", per_token.new_zeros(n))
            diag_out.update(_reduce_diagnostics(values, groups, token_weights != 0))
        return loss, per_token

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_per_token):
        grads = _scaled_grads(ctx, grad_loss, "fused_cross_tokenizer_losses")
        return *grads, None, None, None, None, None, None, None, None


def fused_cross_tokenizer_losses(
    hidden: Tensor,
    lm_head_weight: Tensor,
    teacher_topk_ids: Tensor | None = None,
    teacher_topk_logprobs: Tensor | None = None,
    token_weights: Tensor | None = None,
    config: LossConfig = LossConfig(),
    *,
    target_flags: Tensor,
    sampled_ids: Tensor,
    teacher_token_logprobs: Tensor,
    behavior_logprobs: Tensor | None = None,
    span: SpanTermConfig = SpanTermConfig(),
    return_diagnostics: bool = False,
):
    """(loss, per_token) with loss = sum_i token_weights[i] * per_token[i], from hidden states, chunked.

    `fused_token_losses`'s contract (memory, gradients in the forward, FSDP2) with the hybrid per-token loss of
    `cross_tokenizer_token_losses`; the trainer's `DistillationObjective` calls it in place of
    `fused_token_losses` when its micro-batch carries `target_flags`. `token_weights` of a group's last
    position weigh its span term.
    """
    n, vocab, dtype = _check_hidden_and_head(hidden, lm_head_weight, "fused_cross_tokenizer_losses")
    config, targets, groups = _check_inputs(
        config, n, vocab, hidden.device, dtype, target_flags,
        teacher_topk_ids, teacher_topk_logprobs, sampled_ids, teacher_token_logprobs, behavior_logprobs,
    )  # fmt: skip
    token_weights, need_hidden, need_weight = _weights_and_grad_needs(token_weights, n, dtype, hidden, lm_head_weight)
    diag = {} if return_diagnostics else None
    loss, per_token = _FusedCrossTokenizerLosses.apply(
        hidden, lm_head_weight, token_weights, targets, groups, config, span, need_hidden, need_weight, diag
    )
    return (loss, per_token, diag) if return_diagnostics else (loss, per_token)
