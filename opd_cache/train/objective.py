"""The training objective of one micro-batch, as the forward of a module.

`DistillationObjective` wraps the student and is what the trainer calls (and,
under FSDP2, the root that `fully_shard` wraps last). Computing the loss inside
its forward is what makes the memory-efficient loss work with sharding: the
root's own parameters — the embeddings, the final norm and the output layer,
tied or not — are all-gathered by FSDP2 for the duration of the root forward,
so `fused_token_losses` sees the full output-layer weight [V, H] as a plain
tensor and never the [tokens, V] logits. It computes the weight's gradient in
the forward and hands it to autograd in backward, where FSDP2 reduce-scatters
it with the others.

Loss = distill_weight · distillation + task_reward_weight · task, each a sum of
token_weights × per-token loss over the global batch (token_weights carry the
aggregation, e.g. 1 / global response tokens for token-mean):

* distillation: `fused_token_losses` with the configured divergence (top-k
  divergences, sampled-token estimators, or policy-gradient OPD with
  divergence "pg"); optional truncated importance weights
  min(exp(s − s_behavior), c) for stale rows (top-k divergences; "pg" applies
  its own);
* task (GRPO): PPO-clipped policy gradient with the row's group-normalised
  advantage. It is `pg_loss` with the reward t − s_behavior set to the
  advantage, so it reuses the fused path by passing
  teacher_token_logprobs = advantage + behavior_logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from opd_cache.losses import LOSSES, POLICY_GRADIENT, fused_token_losses
from opd_cache.train.microbatch import MicroBatch


@dataclass(frozen=True)
class LossOptions:
    divergence: str = "forward_kl"
    tail: str = "bucket"
    beta: float = 0.5
    chunk_size: int = 1024
    clip_low: float = 0.2
    clip_high: float = 0.28
    importance_cap: float | None = None
    distill_weight: float = 1.0
    task_reward_weight: float = 0.0

    @property
    def kind(self) -> str:
        if self.divergence == POLICY_GRADIENT:  # "pg": policy-gradient OPD on the sampled token
            return "sampled"
        return LOSSES[self.divergence].kind


@torch.no_grad()
def sampled_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[ids] in chunks of tokens (no [N, V] buffer, no gradient)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    w = weight.float()
    for start in range(0, hidden.shape[0], chunk_size):
        logits = hidden[start : start + chunk_size].float() @ w.t()
        out[start : start + chunk_size] = logits.gather(1, ids[start : start + chunk_size, None]).squeeze(
            1
        ) - logits.logsumexp(1)
    return out


class DistillationObjective(nn.Module):
    """forward(micro_batch) -> (loss, per-token distillation loss, diagnostics)."""

    def __init__(self, model: nn.Module, options: LossOptions):
        super().__init__()
        self.model = model  # a transformers causal LM
        self.options = options

    def forward(self, mb: MicroBatch):
        out = self.model.base_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        hidden = out.last_hidden_state.flatten(0, 1).index_select(0, mb.response_positions)
        weight = self.model.get_output_embeddings().weight  # unsharded here: we are in the root's forward
        # The losses compute in float32 whatever the model's precision; autocast must not recast their matmuls.
        with torch.autocast(hidden.device.type, enabled=False):
            return self._losses(hidden, weight, mb)

    def _losses(self, hidden: torch.Tensor, weight: torch.Tensor, mb: MicroBatch):
        opts = self.options
        token_weights = mb.token_weights * opts.distill_weight
        if opts.importance_cap is not None and opts.kind == "topk":
            s = sampled_token_logprobs(hidden.detach(), weight.detach(), mb.sampled_ids, opts.chunk_size)
            token_weights = token_weights * torch.exp(s - mb.behavior_logprobs).clamp(max=opts.importance_cap)
        loss, per_token, diagnostics = fused_token_losses(
            hidden,
            weight,
            mb.teacher_topk_ids,
            mb.teacher_topk_logprobs,
            token_weights=token_weights,
            chunk_size=opts.chunk_size,
            divergence=opts.divergence,
            tail=opts.tail,
            beta=opts.beta,
            sampled_ids=mb.sampled_ids,
            teacher_token_logprobs=mb.teacher_token_logprobs,
            support_ids=mb.support_ids,
            support_teacher_logprobs=mb.support_logprobs,
            behavior_logprobs=mb.behavior_logprobs if opts.divergence == POLICY_GRADIENT else None,
            clip_low=opts.clip_low,
            clip_high=opts.clip_high,
            importance_cap=opts.importance_cap if opts.divergence == POLICY_GRADIENT else None,
            return_diagnostics=True,
        )
        diagnostics = dict(diagnostics)
        if opts.task_reward_weight > 0:
            task_loss, task_per_token = fused_token_losses(
                hidden,
                weight,
                token_weights=mb.token_weights * opts.task_reward_weight,
                chunk_size=opts.chunk_size,
                divergence=POLICY_GRADIENT,
                sampled_ids=mb.sampled_ids,
                teacher_token_logprobs=mb.advantages + mb.behavior_logprobs,
                behavior_logprobs=mb.behavior_logprobs,
                clip_low=opts.clip_low,
                clip_high=opts.clip_high,
                importance_cap=opts.importance_cap,
            )
            diagnostics["task_loss"] = task_loss.detach()
            diagnostics["distill_loss"] = loss.detach()
            loss = loss + task_loss
        return loss, per_token, diagnostics
