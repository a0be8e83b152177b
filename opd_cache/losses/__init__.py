"""Distillation losses of on-policy distillation, as pure tensor functions.

Notation at one response position (docs/design.md §4): the teacher's distribution p,
the student's q = softmax(student logits) over the full vocabulary V, a support
S of token ids (the teacher's top-k, optionally united with extra ids such as
the student's top-k), and the tail bucket "everything outside S".

Two families of per-token losses:

* top-k divergences (`forward_kl`, `reverse_kl`, `jsd`) between p and q seen
  through S, with one of three tail handlings (`bucket`, `renorm`, `none`);
* sampled-token estimators (`k1`, `k2`, `k3`, `abs`) from s, the student's
  log-prob of the sampled token, and t, the teacher's. `k1` is only valid as
  the reward of policy-gradient OPD (`pg_loss`; on both paths:
  `LossConfig(divergence="pg")`, the same as "k1" with `policy_gradient=True`).

Public API (every name below is importable from `opd_cache.losses`):
    LossConfig(divergence=..., tail=..., beta=..., clip_low=..., ...)   every loss option, validated once
    token_losses(student_logits, teacher_topk_ids, teacher_topk_logprobs, config, ...) -> [N]
    fused_token_losses(hidden, lm_head_weight, ..., token_weights, config, ...) -> (loss, per_token)
    pg_loss(student_logprobs, behavior_logprobs, teacher_token_logprobs, ...) -> [N]
    aggregation_weights(mask, mode, ...) / aggregate(per_token, mask, mode, ...)
    LOSSES, LossSpec, POLICY_GRADIENT, TAILS, AGGREGATIONS, P_TAIL_MIN
    diagnostics: `return_diagnostics=True` on either path (keys in `diagnostics._diagnostics`)

Layout (one concern per module; read in this order):
    config.py        the registry (LOSSES, TAILS, AGGREGATIONS) and LossConfig
    targets.py       the teacher's side (`_Targets`) and the checks of every input tensor
    vocab.py         vocabulary reductions, the only code that touches [tokens, vocab], and their chain rule
    divergences.py   generalized KL / JSD over buckets: the top-k divergences and their tails
    estimators.py    sampled-token estimators (k1/k2/k3/abs) and policy-gradient OPD (`pg_loss`)
    materialised.py  token_losses on materialised logits, and the per-token loss both paths share
    fused.py         fused_token_losses: from hidden states, chunked, gradients in the forward
    cross_tokenizer.py  the hybrid loss on a teacher of another tokenizer (top-k where valid, span term on groups)
    aggregation.py   aggregation over tokens, sequences, micro-batches and ranks
    diagnostics.py   the diagnostics of either path

Both public paths compute the loss from the same four per-token reductions of
the logits (full log-sum-exp, logits at S, log-sum-exp over the complement of
S, logit of the sampled token) and differentiate through them with the same
hand-written chain rule, so they agree to float rounding. The formulas and
conventions are written out in docs/losses.md.
"""

import importlib

from opd_cache.losses.config import AGGREGATIONS, LOSSES, POLICY_GRADIENT, TAILS, LossConfig, LossSpec

# The tensor functions import torch; they load on first use, so that checking the loss options (LossConfig, e.g.
# before the trainer loads a model) does not import torch.
_LAZY = {
    "aggregate": "aggregation",
    "aggregation_weights": "aggregation",
    "P_TAIL_MIN": "divergences",
    "pg_loss": "estimators",
    "fused_token_losses": "fused",
    "cross_tokenizer_token_losses": "cross_tokenizer",  # a teacher of another tokenizer (docs/cross-tokenizer.md)
    "fused_cross_tokenizer_losses": "cross_tokenizer",
    "SpanTermConfig": "cross_tokenizer",
    "token_losses": "materialised",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"opd_cache.losses.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'opd_cache.losses' has no attribute {name!r}")


__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "P_TAIL_MIN",
    "POLICY_GRADIENT",
    "TAILS",
    "LossConfig",
    "LossSpec",
    "SpanTermConfig",
    "aggregate",
    "aggregation_weights",
    "cross_tokenizer_token_losses",
    "fused_cross_tokenizer_losses",
    "fused_token_losses",
    "pg_loss",
    "token_losses",
]
