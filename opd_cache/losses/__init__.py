"""Distillation losses of on-policy distillation, as pure tensor functions.

Notation at one response position (DESIGN.md §4): the teacher's distribution p,
the student's q = softmax(student logits) over the full vocabulary V, a support
S of token ids (the teacher's top-k, optionally united with extra ids such as
the student's top-k), and the tail bucket "everything outside S".

Two families of per-token losses:

* top-k divergences (`forward_kl`, `reverse_kl`, `jsd`) between p and q seen
  through S, with one of three tail handlings:
    - `bucket`: the (|S|+1)-bucket distributions (S plus one tail bucket). Exact,
      >= 0, a lower bound of the full-vocabulary divergence, equal to it when
      S covers the vocabulary.
    - `renorm`: p and q both renormalised over S.
    - `none`: verl's `forward_kl_topk`, sum_S p (log p - log q) with the
      full-vocabulary log q, clamped at 0 (forward KL only, kept for parity).
* sampled-token estimators (`k1`, `k2`, `k3`, `abs`) from s, the student's
  log-prob of the sampled token, and t, the teacher's. `k1` is only valid as
  the reward of policy-gradient OPD (`pg_loss`; in `token_losses` and
  `fused_token_losses`: `divergence="pg"`, the same as "k1" with
  `policy_gradient=True`).

Public API:
    token_losses(student_logits, teacher_topk_ids, teacher_topk_logprobs, ...) -> [N]
    fused_token_losses(hidden, lm_head_weight, ...) -> (loss, per_token)
    pg_loss(student_logprobs, behavior_logprobs, teacher_token_logprobs, ...) -> [N]
    aggregation_weights(mask, mode, ...) / aggregate(per_token, mask, mode, ...)
    LOSSES, POLICY_GRADIENT, TAILS, AGGREGATIONS, P_TAIL_MIN
    diagnostics: `return_diagnostics=True` on either path (keys in `_diagnostics`)

How the code is organised (read in this order):
    1. registry and constants
    2. per-bucket math: the generalized KL term, divergences over buckets
    3. sampled-token estimators and policy-gradient OPD
    4. the support S (union, duplicates) and validation of the inputs
    5. vocabulary reductions: the only place that touches [tokens, vocab]
    6. per-token losses from the reductions (shared by both paths below)
    7. token_losses: on materialised logits
    8. fused_token_losses: from hidden states, chunked, gradients in the forward
    9. aggregation over tokens, sequences, micro-batches and ranks
   10. diagnostics

Both public paths compute the loss from the same four per-token reductions of
the logits (full log-sum-exp, logits at S, log-sum-exp over the complement of
S, logit of the sampled token) and differentiate through them with the same
hand-written chain rule, so they agree to float rounding. The formulas and
conventions are written out in docs/losses.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# ---------------------------------------------------------------------------
# 1. Registry and constants
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LossSpec:
    """What a loss name means and what it needs."""

    name: str
    kind: str  # "topk": needs the teacher's top-k; "sampled": needs the sampled token
    description: str


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("forward_kl", "topk", "KL(p || q), mode-covering (the usual distillation loss)"),
        LossSpec("reverse_kl", "topk", "KL(q || p), mode-seeking"),
        LossSpec("jsd", "topk", "generalized JSD with beta: m = beta*p + (1-beta)*q"),
        LossSpec("k1", "sampled", "s - t; only valid as the reward of policy-gradient OPD (policy_gradient=True)"),
        LossSpec("k2", "sampled", "0.5 * (s - t)^2"),
        LossSpec("k3", "sampled", "exp(t - s) - (t - s) - 1, clamped as verl does"),
        LossSpec("abs", "sampled", "|s - t|"),
    )
}
# "pg" is shorthand for divergence="k1" with policy_gradient=True (the trainer's `loss: pg`).
POLICY_GRADIENT = "pg"
TAILS = ("bucket", "renorm", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# The teacher's tail mass 1 - sum(p_S) is clamped here: it is a difference of
# numbers near 1 and can round to zero or below (float16/float32 log-probs).
P_TAIL_MIN = 1e-12


@dataclass(frozen=True)
class _Options:
    divergence: str = "forward_kl"
    tail: str = "bucket"
    beta: float = 0.5
    policy_gradient: bool = False
    clip_low: float = 0.2
    clip_high: float = 0.2
    importance_cap: float | None = None

    @property
    def kind(self) -> str:
        return LOSSES[self.divergence].kind


# ---------------------------------------------------------------------------
# 2. Per-bucket math
# ---------------------------------------------------------------------------


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


def _divergence_over_buckets(log_p: Tensor, log_q: Tensor, valid: Tensor, opts: _Options) -> Tensor:
    """Divergence between two distributions given as log-masses on buckets [n, B].

    `valid` marks the buckets that exist (duplicates and an empty tail do not).
    """
    # Invalid buckets get finite placeholders so no NaN reaches the gradient.
    log_p = torch.where(valid, log_p, 0.0)
    log_q = torch.where(valid, log_q, 0.0)
    d, beta = opts.divergence, opts.beta
    if d == "forward_kl" or (d == "jsd" and beta == 0.0):
        terms = _generalized_kl(log_p, log_q)
    elif d == "reverse_kl" or (d == "jsd" and beta == 1.0):
        terms = _generalized_kl(log_q, log_p)
    else:  # generalized JSD, 0 < beta < 1
        log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
        terms = beta * _generalized_kl(log_p, log_m) + (1.0 - beta) * _generalized_kl(log_q, log_m)
    return torch.where(valid, terms, 0.0).sum(-1)


# ---------------------------------------------------------------------------
# 3. Sampled-token estimators and policy-gradient OPD
# ---------------------------------------------------------------------------


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
    clip_low: float = 0.2,
    clip_high: float = 0.2,
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
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low} must be in [0, 1)")
    if clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high} must be >= 0")
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


# ---------------------------------------------------------------------------
# 4. The support S and validation of the inputs
# ---------------------------------------------------------------------------


@dataclass
class _Targets:
    """Everything on the teacher's side for N tokens (validated, compute dtype)."""

    support: Tensor  # [N, K] int64: teacher top-k ids, then the extra support ids
    support_logprobs: Tensor  # [N, K] teacher log-probs at `support`
    keep: Tensor  # [N, K] bool: first occurrence of each id (duplicates count once)
    has_tail: Tensor  # [N] bool: S does not cover the whole vocabulary
    topk: int  # number of teacher top-k columns (for the overlap diagnostic)
    sampled: Tensor  # [N] int64 (zeros when not given)
    teacher_token: Tensor | None  # [N]
    behavior: Tensor | None  # [N]

    def rows(self, start: int, end: int) -> _Targets:
        def cut(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[start:end]

        return _Targets(
            self.support[start:end],
            self.support_logprobs[start:end],
            self.keep[start:end],
            self.has_tail[start:end],
            self.topk,
            self.sampled[start:end],
            cut(self.teacher_token),
            cut(self.behavior),
        )


def _first_occurrence(ids: Tensor) -> Tensor:
    """[N, K] bool, True at the first occurrence of each id in its row."""
    if ids.shape[1] <= 1:
        return torch.ones_like(ids, dtype=torch.bool)
    sorted_ids, order = ids.sort(dim=1, stable=True)  # stable: earlier columns first
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    return torch.empty_like(first).scatter_(1, order, first)


def _check_ids(name: str, ids: Tensor, shape: tuple[int, ...], vocab: int) -> Tensor:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if tuple(ids.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(ids.shape)}, expected {shape}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{name} has ids outside [0, V={vocab}): min {int(ids.min())}, max {int(ids.max())}"
            " (teacher and student must share the vocabulary)"
        )
    return ids.long()


def _has_nan(x: Tensor) -> bool:
    # amax propagates NaN: one pass and no [x.shape] bool temporary, unlike isnan(x).any()
    return x.numel() > 0 and bool(torch.isnan(x.amax()))


def _check_values(name: str, x: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a float tensor, got dtype {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")
    if _has_nan(x):
        raise ValueError(f"{name} contains NaN")
    return x.to(dtype)


def _check_options(
    divergence: str,
    tail: str,
    beta: float,
    policy_gradient: bool,
    importance_cap: float | None,
    clip_low: float,
    clip_high: float,
) -> _Options:
    if divergence == POLICY_GRADIENT:
        divergence, policy_gradient = "k1", True
    if divergence not in LOSSES:
        raise ValueError(f"unknown divergence {divergence!r}; expected one of {sorted(LOSSES) + [POLICY_GRADIENT]}")
    if tail not in TAILS:
        raise ValueError(f"unknown tail {tail!r}; expected one of {list(TAILS)}")
    if divergence == "k1" and not policy_gradient:
        raise ValueError(
            "divergence='k1' is not a loss on its own: its gradient, grad log q(sampled), is zero in "
            "expectation; use it as the reward of policy-gradient OPD (divergence='pg', or 'k1' with "
            "policy_gradient=True, plus behavior_logprobs; or pg_loss()), or pick k2, k3 or abs"
        )
    if policy_gradient and divergence != "k1":
        raise ValueError(
            f"policy_gradient=True needs divergence='k1' or 'pg' (its reward is t - s_behavior), got {divergence!r}"
        )
    if LOSSES[divergence].kind == "topk" and tail == "none" and divergence != "forward_kl":
        raise ValueError(
            f"tail='none' (verl's forward_kl_topk) supports divergence='forward_kl' only, got {divergence!r}"
        )
    if divergence == "jsd" and not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1] for divergence='jsd'")
    if policy_gradient:  # validated here so both paths fail before any work
        if not 0.0 <= clip_low < 1.0:
            raise ValueError(f"clip_low={clip_low} must be in [0, 1)")
        if clip_high < 0.0:
            raise ValueError(f"clip_high={clip_high} must be >= 0")
        if importance_cap is not None and not importance_cap > 0.0:
            raise ValueError(f"importance_cap={importance_cap} must be > 0 (or None for no importance weight)")
    return _Options(
        divergence, tail, float(beta), bool(policy_gradient), float(clip_low), float(clip_high), importance_cap
    )


def _check_targets(
    opts: _Options,
    n: int,
    vocab: int,
    device: torch.device,
    dtype: torch.dtype,
    teacher_topk_ids: Tensor | None,
    teacher_topk_logprobs: Tensor | None,
    sampled_ids: Tensor | None,
    teacher_token_logprobs: Tensor | None,
    support_ids: Tensor | None,
    support_teacher_logprobs: Tensor | None,
    behavior_logprobs: Tensor | None,
) -> _Targets:
    # The teacher's top-k: required by top-k divergences, optional (diagnostics) otherwise.
    if (teacher_topk_ids is None) != (teacher_topk_logprobs is None):
        raise ValueError("pass teacher_topk_ids and teacher_topk_logprobs together")
    if teacher_topk_ids is None:
        if opts.kind == "topk":
            raise ValueError(
                f"divergence={opts.divergence!r} needs teacher_topk_ids and teacher_topk_logprobs ([N, k])"
            )
        support = torch.zeros(n, 0, dtype=torch.long, device=device)
        support_logprobs = torch.zeros(n, 0, dtype=dtype, device=device)
    else:
        if teacher_topk_ids.dim() != 2:
            raise ValueError(f"teacher_topk_ids must be [N, k], got shape {tuple(teacher_topk_ids.shape)}")
        k = teacher_topk_ids.shape[1]
        if k > vocab:
            raise ValueError(f"teacher_topk_ids has k={k} columns but the vocabulary has V={vocab} ids; k must be <= V")
        support = _check_ids("teacher_topk_ids", teacher_topk_ids, (n, k), vocab)
        support_logprobs = _check_values("teacher_topk_logprobs", teacher_topk_logprobs, (n, k), dtype)
    topk = support.shape[1]

    # Extra support (e.g. the student's top-k), united with the teacher's top-k.
    if (support_ids is None) != (support_teacher_logprobs is None):
        raise ValueError("pass support_ids and support_teacher_logprobs together (the union support needs both)")
    if support_ids is not None and opts.kind == "topk":
        if support_ids.dim() != 2:
            raise ValueError(f"support_ids must be [N, k_s], got shape {tuple(support_ids.shape)}")
        k_s = support_ids.shape[1]
        extra = _check_ids("support_ids", support_ids, (n, k_s), vocab)
        extra_logprobs = _check_values("support_teacher_logprobs", support_teacher_logprobs, (n, k_s), dtype)
        support = torch.cat([support, extra], 1)
        support_logprobs = torch.cat([support_logprobs, extra_logprobs], 1)
    keep = _first_occurrence(support)
    has_tail = keep.sum(1) < vocab

    # The sampled token: required by the sampled-token estimators, optional otherwise.
    if opts.kind == "sampled":
        for name, x in (("sampled_ids", sampled_ids), ("teacher_token_logprobs", teacher_token_logprobs)):
            if x is None:
                raise ValueError(f"divergence={opts.divergence!r} needs {name} ([N])")
    if opts.policy_gradient and behavior_logprobs is None:
        raise ValueError("policy-gradient OPD needs behavior_logprobs ([N], log-probs of the sampling policy)")
    sampled = (
        torch.zeros(n, dtype=torch.long, device=device)
        if sampled_ids is None
        else _check_ids("sampled_ids", sampled_ids, (n,), vocab)
    )
    if teacher_token_logprobs is not None:
        teacher_token_logprobs = _check_values("teacher_token_logprobs", teacher_token_logprobs, (n,), dtype)
    if behavior_logprobs is not None:
        behavior_logprobs = _check_values("behavior_logprobs", behavior_logprobs, (n,), dtype)
    if sampled_ids is None:  # a teacher token log-prob without its token id is meaningless
        teacher_token_logprobs = None
    return _Targets(support, support_logprobs, keep, has_tail, topk, sampled, teacher_token_logprobs, behavior_logprobs)


# ---------------------------------------------------------------------------
# 5. Vocabulary reductions: the only code that touches [tokens, vocab]
# ---------------------------------------------------------------------------


@dataclass
class _VocabStats:
    """Per-token reductions of the logits z; every loss is a function of these."""

    lse: Tensor  # [n] logsumexp(z): log of the normaliser of q
    z_support: Tensor  # [n, K] z at the support ids
    lse_tail: Tensor  # [n] logsumexp of z outside S (-inf when S covers the vocabulary)
    z_sampled: Tensor  # [n] z at the sampled token


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


# ---------------------------------------------------------------------------
# 6. Per-token losses from the reductions (shared by both public paths)
# ---------------------------------------------------------------------------


def _teacher_tail_logmass(targets: _Targets) -> Tensor:
    """log p_tail, p_tail = 1 - sum_S p clamped at P_TAIL_MIN (summed in float64)."""
    p_support = targets.support_logprobs.double().exp() * targets.keep
    p_tail = (1.0 - p_support.sum(1)).clamp_min(P_TAIL_MIN)
    return p_tail.log().to(targets.support_logprobs.dtype)


def _masked_logsumexp(x: Tensor, keep: Tensor) -> Tensor:
    return torch.logsumexp(x.masked_fill(~keep, -math.inf), 1, keepdim=True)


def _per_token(stats: _VocabStats, targets: _Targets, opts: _Options) -> Tensor:
    """Per-token loss [n], differentiable w.r.t. the fields of `stats`."""
    if opts.kind == "sampled":
        s = stats.z_sampled - stats.lse
        if opts.policy_gradient:
            return pg_loss(
                s, targets.behavior, targets.teacher_token, opts.clip_low, opts.clip_high, opts.importance_cap
            )
        return _sampled_estimator(s, targets.teacher_token, opts.divergence)

    keep = targets.keep
    log_q_support = stats.z_support - stats.lse[:, None]
    if opts.tail == "none":  # verl's forward_kl_topk
        p = targets.support_logprobs.exp()
        terms = p * (targets.support_logprobs - log_q_support)
        return torch.where(keep, terms, 0.0).sum(1).clamp_min(0.0)
    if opts.tail == "renorm":  # both renormalised over S (student from its logits at S)
        log_p = targets.support_logprobs - _masked_logsumexp(targets.support_logprobs, keep)
        log_q = stats.z_support - _masked_logsumexp(stats.z_support, keep)
        return _divergence_over_buckets(log_p, log_q, keep, opts)
    # bucket: S plus one tail bucket
    log_q_tail = stats.lse_tail - stats.lse
    log_p = torch.cat([targets.support_logprobs, _teacher_tail_logmass(targets)[:, None]], 1)
    log_q = torch.cat([log_q_support, log_q_tail[:, None]], 1)
    valid = torch.cat([keep, targets.has_tail[:, None]], 1)
    return _divergence_over_buckets(log_p, log_q, valid, opts)


# ---------------------------------------------------------------------------
# 7. token_losses: on materialised logits
# ---------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_losses(
    student_logits: Tensor,
    teacher_topk_ids: Tensor | None = None,
    teacher_topk_logprobs: Tensor | None = None,
    divergence: str = "forward_kl",
    tail: str = "bucket",
    beta: float = 0.5,
    sampled_ids: Tensor | None = None,
    teacher_token_logprobs: Tensor | None = None,
    support_ids: Tensor | None = None,
    support_teacher_logprobs: Tensor | None = None,
    *,
    behavior_logprobs: Tensor | None = None,
    policy_gradient: bool = False,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    importance_cap: float | None = None,
    return_diagnostics: bool = False,
):
    """Per-token distillation loss [N] from student logits [N, V].

    Differentiable w.r.t. `student_logits` only; computed in float32 (float64
    for float64 logits). `teacher_topk_ids/logprobs` ([N, k], full-vocabulary
    log-probs) are needed by the top-k divergences; `sampled_ids` and
    `teacher_token_logprobs` ([N]) by k1/k2/k3/abs; `behavior_logprobs` by
    `policy_gradient=True` (divergence='k1', see `pg_loss`). `support_ids` with
    `support_teacher_logprobs` ([N, k_s]) extend S (union support; an id in
    both counts once). With `return_diagnostics=True` returns
    (per_token, diagnostics) — see `_diagnostics`.
    """
    opts = _check_options(divergence, tail, beta, policy_gradient, importance_cap, clip_low, clip_high)
    if student_logits.dim() != 2 or not student_logits.dtype.is_floating_point:
        raise ValueError(
            f"student_logits must be a float [N, V] tensor, got {student_logits.dtype}"
            f" of shape {tuple(student_logits.shape)}"
        )
    if _has_nan(student_logits):
        raise ValueError("student_logits contains NaN")
    n, vocab = student_logits.shape
    dtype = _compute_dtype(student_logits.dtype)
    targets = _check_targets(
        opts, n, vocab, student_logits.device, dtype,
        teacher_topk_ids, teacher_topk_logprobs, sampled_ids, teacher_token_logprobs,
        support_ids, support_teacher_logprobs, behavior_logprobs,
    )  # fmt: skip
    z = student_logits.to(dtype)
    stats = _VocabStats(*_VocabReduction.apply(z, targets))
    per_token = _per_token(stats, targets, opts)
    if not return_diagnostics:
        return per_token
    with torch.no_grad():
        topk_ids = z.topk(targets.topk, dim=1).indices if targets.topk else None
        parts = _diagnostic_parts(_detach(stats), targets, per_token.detach(), topk_ids)
    return per_token, _diagnostics(parts, torch.ones(n, dtype=torch.bool, device=z.device))


def _detach(stats: _VocabStats) -> _VocabStats:
    return _VocabStats(stats.lse.detach(), stats.z_support.detach(), stats.lse_tail.detach(), stats.z_sampled.detach())


# ---------------------------------------------------------------------------
# 8. fused_token_losses: from hidden states, in chunks, gradients in the forward
# ---------------------------------------------------------------------------


def _fused_chunk(h: Tensor, w: Tensor, t: _Targets, weights: Tensor, opts: _Options, need_grad: bool, want_diag: bool):
    """One chunk: (per-token losses, d(sum weights*loss)/d(logits) or None, diagnostic parts or None).

    The logits buffer [n, V] is the only large allocation; it becomes the gradient in place.
    """
    logits = h @ w.t()
    stats, buf, aux, topk_ids = _reduce_vocab(logits, t, overwrite=True, student_topk=t.topk if want_diag else 0)
    grad_logits = None
    if need_grad:
        reductions = (stats.lse, stats.z_support, stats.lse_tail, stats.z_sampled)
        leaves = [x.detach().requires_grad_() for x in reductions]
        with torch.enable_grad():  # a tiny local graph on [n, |S| + 3] numbers
            loss_rows = _per_token(_VocabStats(*leaves), t, opts)
            grads = torch.autograd.grad((loss_rows * weights).sum(), leaves, allow_unused=True)
        loss_rows = loss_rows.detach()
        grad_logits = _vocab_grad_(buf, aux, stats, t, *grads)
    else:
        loss_rows = _per_token(stats, t, opts)
    diag_rows = _diagnostic_parts(stats, t, loss_rows, topk_ids) if want_diag else None
    return loss_rows, grad_logits, diag_rows


class _FusedTokenLosses(torch.autograd.Function):
    """sum_i w_i * loss_i from hidden states without materialising [N, V].

    For each chunk of tokens: logits = h @ W^T (float32), the reductions, the
    per-token loss and its gradient w.r.t. the reductions (a tiny local
    autograd call), the chain rule to the logits in place, and the two
    gradient matmuls accumulated into grad_hidden and grad_weight. Backward
    only scales them by the incoming gradient, so no logits are recomputed
    and W is not needed after the forward (FSDP2 may reshard it).
    """

    @staticmethod
    def forward(ctx, hidden, weight, token_weights, targets, opts, chunk_size, need_hidden, need_weight, diag_out):
        dtype = _compute_dtype(hidden.dtype)
        w = weight if weight.dtype == dtype else weight.to(dtype)  # one copy for low-precision weights
        n = hidden.shape[0]
        per_token = torch.zeros(n, dtype=dtype, device=hidden.device)
        # Every row of grad_hidden is written by one chunk; grad_weight starts as the first chunk's product.
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_hidden else None
        grad_weight = None
        parts = []
        for start in range(0, n, chunk_size):
            end = min(n, start + chunk_size)
            h = hidden[start:end].to(dtype)
            t = targets.rows(start, end)
            loss_rows, grad_logits, diag_rows = _fused_chunk(
                h, w, t, token_weights[start:end], opts, need_hidden or need_weight, diag_out is not None
            )
            if need_hidden:
                torch.mm(grad_logits, w, out=grad_hidden[start:end])
            if need_weight and grad_weight is None:
                grad_weight = grad_logits.t() @ h
            elif need_weight:
                grad_weight.addmm_(grad_logits.t(), h)
            del grad_logits  # free this chunk's [chunk, V] buffer before the next chunk allocates one
            per_token[start:end] = loss_rows
            if diag_rows is not None:
                parts.append(diag_rows)
        loss = (per_token * token_weights).sum()
        if diag_out is not None:
            diag_out.update(_diagnostics(_concat_parts(parts, per_token), token_weights != 0))
        if need_weight and grad_weight is None:  # no tokens
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        if grad_weight is not None and weight.dtype != dtype:
            grad_weight = grad_weight.to(weight.dtype)
        # Kept as attributes, not saved tensors, so backward can hand them over
        # without a copy (autograd steals a gradient nobody else references).
        ctx.grads = (grad_hidden, grad_weight)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(per_token)
        return loss, per_token

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_per_token):
        if ctx.grads is None:
            raise RuntimeError(
                "fused_token_losses supports one backward pass per forward (retain_graph is not supported)"
            )
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        # In place: these buffers were made for this backward and are used once.
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_loss).to(ctx.hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _is_sharded(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def fused_token_losses(
    hidden: Tensor,
    lm_head_weight: Tensor,
    teacher_topk_ids: Tensor | None = None,
    teacher_topk_logprobs: Tensor | None = None,
    token_weights: Tensor | None = None,
    chunk_size: int = 1024,
    *,
    divergence: str = "forward_kl",
    tail: str = "bucket",
    beta: float = 0.5,
    sampled_ids: Tensor | None = None,
    teacher_token_logprobs: Tensor | None = None,
    support_ids: Tensor | None = None,
    support_teacher_logprobs: Tensor | None = None,
    behavior_logprobs: Tensor | None = None,
    policy_gradient: bool = False,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    importance_cap: float | None = None,
    return_diagnostics: bool = False,
):
    """(loss, per_token) with loss = sum_i token_weights[i] * per_token[i].

    Equals `token_losses(hidden @ lm_head_weight.T, ...)` without holding the
    [N, V] logits: peak extra memory is one [chunk_size, V] float32 buffer
    plus float32 gradient accumulators of the sizes of `hidden` and the
    weight. `loss` is differentiable w.r.t. `hidden` and `lm_head_weight`
    (pass the embedding weight when they are tied); `token_weights` ([N],
    default ones, e.g. `aggregation_weights(...)` flattened) are constants;
    `per_token` is detached. With `return_diagnostics=True` returns
    (loss, per_token, diagnostics) over the tokens with a non-zero weight.

    Under FSDP2 the weight must be unsharded when this is called: call it in
    the forward of the FSDP module that owns the output layer (or in a method
    registered with `register_fsdp_forward_method`); see docs/losses.md.
    """
    opts = _check_options(divergence, tail, beta, policy_gradient, importance_cap, clip_low, clip_high)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    if hidden.dim() != 2 or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be a float [N, H] tensor, got {hidden.dtype} of shape {tuple(hidden.shape)}")
    if _is_sharded(lm_head_weight):
        raise ValueError(
            "lm_head_weight is a sharded DTensor: call fused_token_losses inside the forward of the FSDP "
            "module that owns it (or after module.unshard()), where its parameters are plain tensors"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"lm_head_weight must be [V, H={hidden.shape[1]}], got shape {tuple(lm_head_weight.shape)}")
    if _has_nan(hidden):
        raise ValueError("hidden contains NaN")
    if _has_nan(lm_head_weight):
        raise ValueError("lm_head_weight contains NaN")
    n, vocab = hidden.shape[0], lm_head_weight.shape[0]
    dtype = _compute_dtype(hidden.dtype)
    targets = _check_targets(
        opts, n, vocab, hidden.device, dtype,
        teacher_topk_ids, teacher_topk_logprobs, sampled_ids, teacher_token_logprobs,
        support_ids, support_teacher_logprobs, behavior_logprobs,
    )  # fmt: skip
    if token_weights is None:
        token_weights = torch.ones(n, dtype=dtype, device=hidden.device)
    else:
        token_weights = _check_values("token_weights", token_weights, (n,), dtype).detach()
    grad_on = torch.is_grad_enabled()
    need_hidden = grad_on and hidden.requires_grad
    need_weight = grad_on and lm_head_weight.requires_grad
    diag = {} if return_diagnostics else None
    loss, per_token = _FusedTokenLosses.apply(
        hidden, lm_head_weight, token_weights, targets, opts, chunk_size, need_hidden, need_weight, diag
    )
    return (loss, per_token, diag) if return_diagnostics else (loss, per_token)


# ---------------------------------------------------------------------------
# 9. Aggregation over tokens, sequences, micro-batches and ranks
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# 10. Diagnostics
# ---------------------------------------------------------------------------


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
