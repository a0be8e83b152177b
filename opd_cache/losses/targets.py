"""The teacher's side of N tokens (`_Targets`) and the checks of every input tensor.

Both public paths call `_check_targets` once per call: it validates shapes,
dtypes, id ranges and NaNs with a message naming the argument, unites the
support S (the teacher's top-k plus any extra ids such as the student's
top-k; an id in both counts once) and converts the values to the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from opd_cache.losses.config import LossConfig


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


def _check_config(config: LossConfig) -> LossConfig:
    if not isinstance(config, LossConfig):  # e.g. a divergence name where the old signature had one
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__} {config!r}")
    return config


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_student_logits(student_logits: Tensor) -> tuple[int, int, torch.dtype]:
    """(N, V, compute dtype) of student logits [N, V], checked: a float matrix without NaN."""
    if student_logits.dim() != 2 or not student_logits.dtype.is_floating_point:
        raise ValueError(
            f"student_logits must be a float [N, V] tensor, got {student_logits.dtype}"
            f" of shape {tuple(student_logits.shape)}"
        )
    if _has_nan(student_logits):
        raise ValueError("student_logits contains NaN")
    n, vocab = student_logits.shape
    return n, vocab, _compute_dtype(student_logits.dtype)


def _check_targets(
    config: LossConfig,
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
        if config.kind == "topk":
            raise ValueError(
                f"divergence={config.divergence!r} needs teacher_topk_ids and teacher_topk_logprobs ([N, k])"
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
    if support_ids is not None and config.kind == "topk":
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
    if config.kind == "sampled":
        for name, x in (("sampled_ids", sampled_ids), ("teacher_token_logprobs", teacher_token_logprobs)):
            if x is None:
                raise ValueError(f"divergence={config.divergence!r} needs {name} ([N])")
    if config.policy_gradient and behavior_logprobs is None:
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
