"""`fused_token_losses`: the loss from hidden states, in chunks of tokens, gradients in the forward.

Never holds the [N, V] logits: for each chunk it computes logits = h @ W^T,
the vocabulary reductions, the per-token loss and its gradient w.r.t. the
reductions (a tiny local autograd call), the chain rule to the logits in
place, and the two gradient matmuls accumulated into grad_hidden and
grad_weight. Backward only scales those by the incoming gradient (docs/losses.md,
"The fused path"; FSDP2: "How the trainer calls it under FSDP2").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from opd_cache.losses.config import LossConfig
from opd_cache.losses.diagnostics import _concat_parts, _diagnostic_parts, _diagnostics
from opd_cache.losses.materialised import _per_token
from opd_cache.losses.targets import _check_config, _check_targets, _check_values, _compute_dtype, _has_nan, _Targets
from opd_cache.losses.vocab import _reduce_vocab, _vocab_grad_, _VocabStats


def _fused_chunk(
    h: Tensor,
    w: Tensor,
    t: _Targets,
    weights: Tensor,
    per_token: Callable[[_VocabStats], Tensor],
    diagnostic_parts: Callable[[_VocabStats, Tensor, Tensor | None], dict] | None,
    need_grad: bool,
):
    """One chunk: (per-token losses, d(sum weights*loss)/d(logits) or None, diagnostic parts or None).

    `per_token(stats)` is the loss on the chunk's reductions (`_per_token` here, the hybrid loss in
    cross_tokenizer.py); `diagnostic_parts(stats, losses, student top-k ids)` is given when diagnostics are
    wanted. The logits buffer [n, V] is the only large allocation; it becomes the gradient in place.
    """
    logits = h @ w.t()
    student_topk = t.topk if diagnostic_parts is not None else 0
    stats, buf, aux, topk_ids = _reduce_vocab(logits, t, overwrite=True, student_topk=student_topk)
    grad_logits = None
    if need_grad:
        reductions = (stats.lse, stats.z_support, stats.lse_tail, stats.z_sampled)
        leaves = [x.detach().requires_grad_() for x in reductions]
        with torch.enable_grad():  # a tiny local graph on [n, |S| + 3] numbers
            loss_rows = per_token(_VocabStats(*leaves))
            grads = torch.autograd.grad((loss_rows * weights).sum(), leaves, allow_unused=True)
        loss_rows = loss_rows.detach()
        grad_logits = _vocab_grad_(buf, aux, stats, t, *grads)
    else:
        loss_rows = per_token(stats)
    diag_rows = diagnostic_parts(stats, loss_rows, topk_ids) if diagnostic_parts is not None else None
    return loss_rows, grad_logits, diag_rows


# chunk(start, end, h, w) -> (per-token losses, gradient w.r.t. the chunk's logits or None, diagnostic parts)
ChunkFn = Callable[[int, int, Tensor, Tensor], tuple[Tensor, Tensor | None, dict | None]]


def _chunked_forward(
    ctx,
    hidden: Tensor,
    weight: Tensor,
    token_weights: Tensor,
    bounds: Iterable[tuple[int, int]],
    chunk: ChunkFn,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor, list[dict]]:
    """The forward of the fused autograd functions: (loss, per_token, the chunks' diagnostic parts).

    `bounds` are the chunks' (start, end) rows, in order and covering [0, N); `chunk` computes one of them.
    The two gradient matmuls are accumulated here, so only one chunk's [chunk, V] buffer is alive at a time,
    and kept on `ctx` for `_scaled_grads`.
    """
    dtype = _compute_dtype(hidden.dtype)
    w = weight if weight.dtype == dtype else weight.to(dtype)  # one copy for low-precision weights
    per_token = torch.zeros(hidden.shape[0], dtype=dtype, device=hidden.device)
    # Every row of grad_hidden is written by one chunk; grad_weight starts as the first chunk's product.
    grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_hidden else None
    grad_weight = None
    parts = []
    for start, end in bounds:
        h = hidden[start:end].to(dtype)
        loss_rows, grad_logits, diag_rows = chunk(start, end, h, w)
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
    if need_weight and grad_weight is None:  # no tokens
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
    if grad_weight is not None and weight.dtype != dtype:
        grad_weight = grad_weight.to(weight.dtype)
    # Kept as attributes, not saved tensors, so backward can hand them over
    # without a copy (autograd steals a gradient nobody else references).
    ctx.grads = (grad_hidden, grad_weight)
    ctx.hidden_dtype = hidden.dtype
    ctx.mark_non_differentiable(per_token)
    return loss, per_token, parts


def _scaled_grads(ctx, grad_loss: Tensor, name: str) -> tuple[Tensor | None, Tensor | None]:
    """Backward of a fused loss: the kept (grad_hidden, grad_weight) scaled by the incoming gradient, once."""
    if ctx.grads is None:
        raise RuntimeError(f"{name} supports one backward pass per forward (retain_graph is not supported)")
    grad_hidden, grad_weight = ctx.grads
    ctx.grads = None
    # In place: these buffers were made for this backward and are used once.
    if grad_hidden is not None:
        grad_hidden = grad_hidden.mul_(grad_loss).to(ctx.hidden_dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.mul_(grad_loss.to(grad_weight.dtype))
    return grad_hidden, grad_weight


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
    def forward(ctx, hidden, weight, token_weights, targets, config, need_hidden, need_weight, diag_out):
        n, chunk_size = hidden.shape[0], config.chunk_size

        def chunk(start: int, end: int, h: Tensor, w: Tensor):
            t = targets.rows(start, end)

            def diagnostic_parts(stats: _VocabStats, losses: Tensor, topk_ids: Tensor | None) -> dict:
                return _diagnostic_parts(stats, t, losses, topk_ids)

            per_token = partial(_per_token, targets=t, config=config)
            want_diag = diagnostic_parts if diag_out is not None else None
            return _fused_chunk(h, w, t, token_weights[start:end], per_token, want_diag, need_hidden or need_weight)

        bounds = ((start, min(n, start + chunk_size)) for start in range(0, n, chunk_size))
        loss, per_token, parts = _chunked_forward(
            ctx, hidden, weight, token_weights, bounds, chunk, need_hidden, need_weight
        )
        if diag_out is not None:
            diag_out.update(_diagnostics(_concat_parts(parts, per_token), token_weights != 0))
        return loss, per_token

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_per_token):
        return *_scaled_grads(ctx, grad_loss, "fused_token_losses"), None, None, None, None, None, None


def _is_sharded(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _check_hidden_and_head(hidden: Tensor, lm_head_weight: Tensor, caller: str) -> tuple[int, int, torch.dtype]:
    """(N, V, compute dtype) of hidden states [N, H] and an output layer's weight [V, H], checked.

    `caller` names the public function in the error for a still-sharded FSDP2 weight.
    """
    if hidden.dim() != 2 or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be a float [N, H] tensor, got {hidden.dtype} of shape {tuple(hidden.shape)}")
    if _is_sharded(lm_head_weight):
        raise ValueError(
            f"lm_head_weight is a sharded DTensor: call {caller} inside the forward of the FSDP "
            "module that owns it (or after module.unshard()), where its parameters are plain tensors"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"lm_head_weight must be [V, H={hidden.shape[1]}], got shape {tuple(lm_head_weight.shape)}")
    if _has_nan(hidden):
        raise ValueError("hidden contains NaN")
    if _has_nan(lm_head_weight):
        raise ValueError("lm_head_weight contains NaN")
    return hidden.shape[0], lm_head_weight.shape[0], _compute_dtype(hidden.dtype)


def _weights_and_grad_needs(
    token_weights: Tensor | None, n: int, dtype: torch.dtype, hidden: Tensor, lm_head_weight: Tensor
) -> tuple[Tensor, bool, bool]:
    """(token weights [N], checked and detached, default ones; need grad_hidden; need grad_weight)."""
    if token_weights is None:
        token_weights = torch.ones(n, dtype=dtype, device=hidden.device)
    else:
        token_weights = _check_values("token_weights", token_weights, (n,), dtype).detach()
    grad_on = torch.is_grad_enabled()
    return token_weights, grad_on and hidden.requires_grad, grad_on and lm_head_weight.requires_grad


def fused_token_losses(
    hidden: Tensor,
    lm_head_weight: Tensor,
    teacher_topk_ids: Tensor | None = None,
    teacher_topk_logprobs: Tensor | None = None,
    token_weights: Tensor | None = None,
    config: LossConfig = LossConfig(),
    *,
    sampled_ids: Tensor | None = None,
    teacher_token_logprobs: Tensor | None = None,
    support_ids: Tensor | None = None,
    support_teacher_logprobs: Tensor | None = None,
    behavior_logprobs: Tensor | None = None,
    return_diagnostics: bool = False,
):
    """(loss, per_token) with loss = sum_i token_weights[i] * per_token[i].

    Equals `token_losses(hidden @ lm_head_weight.T, ..., config)` without
    holding the [N, V] logits: peak extra memory is one [config.chunk_size, V]
    float32 buffer plus float32 gradient accumulators of the sizes of `hidden`
    and the weight. `loss` is differentiable w.r.t. `hidden` and
    `lm_head_weight` (pass the embedding weight when they are tied);
    `token_weights` ([N], default ones, e.g. `aggregation_weights(...)`
    flattened) are constants; `per_token` is detached. With
    `return_diagnostics=True` returns (loss, per_token, diagnostics) over the
    tokens with a non-zero weight.

    Under FSDP2 the weight must be unsharded when this is called: call it in
    the forward of the FSDP module that owns the output layer (or in a method
    registered with `register_fsdp_forward_method`); see docs/losses.md.
    """
    config = _check_config(config)
    n, vocab, dtype = _check_hidden_and_head(hidden, lm_head_weight, "fused_token_losses")
    targets = _check_targets(
        config, n, vocab, hidden.device, dtype,
        teacher_topk_ids, teacher_topk_logprobs, sampled_ids, teacher_token_logprobs,
        support_ids, support_teacher_logprobs, behavior_logprobs,
    )  # fmt: skip
    token_weights, need_hidden, need_weight = _weights_and_grad_needs(token_weights, n, dtype, hidden, lm_head_weight)
    diag = {} if return_diagnostics else None
    loss, per_token = _FusedTokenLosses.apply(
        hidden, lm_head_weight, token_weights, targets, config, need_hidden, need_weight, diag
    )
    return (loss, per_token, diag) if return_diagnostics else (loss, per_token)
