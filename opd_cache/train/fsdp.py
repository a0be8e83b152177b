"""FSDP2 for the student: `fully_shard` each decoder block, then the root.

The root is the `DistillationObjective` wrapper, so its own parameters — the
embeddings, the final norm and the output layer (tied or not) — form the root's
parameter group: FSDP2 all-gathers them for the whole root forward, which is
where the fused loss reads the output-layer weight (see objective.py).

Gradients are *summed* over ranks (divide factor 1, SUM collectives): the loss of each
micro-batch is already normalised by the global token count of the optimizer
step, so the sum over micro-batches and ranks is the full-batch gradient.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers causal LM (`model.model.layers` for Llama/Qwen/Mistral/…)."""
    base = model.base_model
    for name in ("layers", "h", "blocks"):
        blocks = getattr(base, name, None)
        if isinstance(blocks, nn.ModuleList):
            return list(blocks)
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} (looked for layers, h, blocks)")


def apply_fsdp(objective: nn.Module, mesh, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard `objective` (a DistillationObjective) in place over `mesh`; returns it."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype
        else MixedPrecisionPolicy()
    )
    for block in decoder_blocks(objective.model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(objective, mesh=mesh, mp_policy=mp)
    for module in objective.modules():
        if isinstance(module, FSDPModule):
            # plain SUM collectives with no pre/post scaling (gloo has no PREMUL_SUM / AVG)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return objective
