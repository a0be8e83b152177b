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

The options are one `LossConfig` (opd_cache/losses/config.py), built by the
trainer from its `TrainConfig` (`LossConfig.from_train_config`).

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

from dataclasses import replace
from functools import partial

import torch
from torch import nn

from opd_cache.losses import (
    POLICY_GRADIENT,
    LossConfig,
    SpanTermConfig,
    fused_cross_tokenizer_losses,
    fused_token_losses,
)
from opd_cache.train.microbatch import MicroBatch


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

    def __init__(self, model: nn.Module, config: LossConfig, span: SpanTermConfig | None = None):
        super().__init__()
        self.model = model  # a transformers causal LM
        self.config = config
        self.span = span or SpanTermConfig()  # the span term of cross-tokenizer micro-batches (target_flags)
        # The GRPO task loss is policy-gradient OPD with the same clip range and importance cap.
        self.task_config = replace(config, divergence=POLICY_GRADIENT) if config.task_reward_weight > 0 else None

    def forward(self, mb: MicroBatch):
        out = self.model.base_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        hidden = out.last_hidden_state.flatten(0, 1).index_select(0, mb.response_positions)
        weight = self.model.get_output_embeddings().weight  # unsharded here: we are in the root's forward
        # The losses compute in float32 whatever the model's precision; autocast must not recast their matmuls.
        with torch.autocast(hidden.device.type, enabled=False):
            return self._losses(hidden, weight, mb)

    def _losses(self, hidden: torch.Tensor, weight: torch.Tensor, mb: MicroBatch):
        config = self.config
        token_weights = mb.token_weights * config.distill_weight
        importance = {}
        if config.importance_cap is not None and config.kind == "topk":  # "pg" applies its own
            s = sampled_token_logprobs(hidden.detach(), weight.detach(), mb.sampled_ids, config.chunk_size)
            ratio = torch.exp(s - mb.behavior_logprobs)
            is_weight = ratio.clamp(max=config.importance_cap)
            token_weights = token_weights * is_weight
            # means over the trained tokens, as the losses' own diagnostics (the trainer logs them per step)
            trained = mb.token_weights != 0
            importance = {
                "importance_weight": is_weight[trained].mean(),
                "importance_clipped": (ratio[trained] > config.importance_cap).float().mean(),
            }
        if mb.target_flags is not None:  # a teacher of another tokenizer: top-k where valid, span terms elsewhere
            distillation = partial(fused_cross_tokenizer_losses, target_flags=mb.target_flags, span=self.span)
        else:
            distillation = partial(
                fused_token_losses, support_ids=mb.support_ids, support_teacher_logprobs=mb.support_logprobs
            )
        loss, per_token, diagnostics = distillation(
            hidden,
            weight,
            mb.teacher_topk_ids,
            mb.teacher_topk_logprobs,
            token_weights,
            config,
            sampled_ids=mb.sampled_ids,
            teacher_token_logprobs=mb.teacher_token_logprobs,
            behavior_logprobs=mb.behavior_logprobs if config.policy_gradient else None,
            return_diagnostics=True,
        )
        diagnostics = dict(diagnostics, **importance)
        if self.task_config is not None:
            task_loss, task_per_token = fused_token_losses(
                hidden,
                weight,
                token_weights=mb.token_weights * config.task_reward_weight,
                config=self.task_config,
                sampled_ids=mb.sampled_ids,
                teacher_token_logprobs=mb.advantages + mb.behavior_logprobs,
                behavior_logprobs=mb.behavior_logprobs,
            )
            diagnostics["task_loss"] = task_loss.detach()
            diagnostics["distill_loss"] = loss.detach()
            loss = loss + task_loss
        return loss, per_token, diagnostics
