"""The numbers one optimizer step logs, summed over its micro-batches and, under torchrun, over its ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# Diagnostics of the losses module averaged over the step's tokens (weighted by each micro-batch's count).
MEAN_DIAGNOSTICS = (
    "loss_mean",
    "teacher_mass_support",
    "student_mass_support",
    "teacher_tail_mass",
    "student_tail_mass",
    "topk_overlap",
    "k1",
    "importance_weight",  # with train.importance_cap (top-k losses): the mean truncated IS weight
    "importance_clipped",  # ... and the share of tokens whose ratio the cap truncated
)


class StepStats:
    """Loss, token count, token-weighted diagnostic means, loss extremes and the task/distill split of a step."""

    def __init__(self):
        # [loss, tokens, Σ tokens·mean for each MEAN_DIAGNOSTICS, task_loss, distill_loss]
        self.sums = torch.zeros(2 + len(MEAN_DIAGNOSTICS) + 2, dtype=torch.float64)
        self.extremes = torch.tensor([math.inf, math.inf], dtype=torch.float64)  # [loss_min, -loss_max]

    def add(self, loss: torch.Tensor, diag: dict) -> None:
        """One micro-batch's loss and the objective's diagnostics."""
        sums, tokens = self.sums, float(diag["tokens"])
        sums[0] += float(loss.detach())
        sums[1] += tokens
        if tokens > 0:
            for j, key in enumerate(MEAN_DIAGNOSTICS):
                if key in diag:
                    sums[2 + j] += tokens * float(diag[key])
            self.extremes[0] = min(self.extremes[0], float(diag["loss_min"]))
            self.extremes[1] = min(self.extremes[1], -float(diag["loss_max"]))
        if "task_loss" in diag:
            sums[-2] += float(diag["task_loss"])
            sums[-1] += float(diag["distill_loss"])

    def all_reduce(self, device: torch.device) -> None:
        """Sum over the ranks (the extremes: min), so every rank holds the step's totals."""
        sums, extremes = self.sums.to(device), self.extremes.to(device)
        dist.all_reduce(sums)
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
        self.sums, self.extremes = sums.cpu(), extremes.cpu()

    @property
    def tokens(self) -> float:
        return float(self.sums[1])

    def record(self, with_task: bool) -> dict:
        """loss, tokens, loss_min/max, each MEAN_DIAGNOSTICS key (None without tokens), task_loss/distill_loss."""
        tokens = self.tokens
        out = {
            "loss": float(self.sums[0]),
            "tokens": int(tokens),
            "loss_min": float(self.extremes[0]) if tokens else None,
            "loss_max": -float(self.extremes[1]) if tokens else None,
        }
        for j, key in enumerate(MEAN_DIAGNOSTICS):
            out[key] = float(self.sums[2 + j]) / tokens if tokens else None
        if with_task:
            out["task_loss"], out["distill_loss"] = float(self.sums[-2]), float(self.sums[-1])
        return out
