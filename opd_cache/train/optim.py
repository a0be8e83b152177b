"""The optimizer and its learning-rate schedule."""

from __future__ import annotations

import math

import torch

from opd_cache.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over every parameter of `model` (after FSDP2 sharding: the shards)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then constant or cosine decay to `min_lr` at `max_steps`."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def low_precision_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The dtype of autocast (one process) or of FSDP2's parameters (torchrun) for `train.mixed_precision`."""
    if mode == "bf16":
        return torch.bfloat16
    if mode == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None
