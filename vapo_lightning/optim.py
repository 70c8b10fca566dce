"""The optimisers of the actor and the critic: AdamW with the paper's linear warm-up (§5.1),
on torch's fused kernel where the parameters allow it."""

from __future__ import annotations

import torch
from torch import Tensor

from vapo_lightning.config import Optim

__all__ = ["adamw_with_warmup", "fused_adamw"]


def adamw_with_warmup(
    params: list[Tensor], lr: float, o: Optim
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` at `lr` with `o`'s betas and weight decay, and its schedule: a
    linear warm-up over `o.warmup_steps` optimiser steps, then constant (§5.1)."""
    opt = torch.optim.AdamW(params, lr=lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused_adamw(params))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (o.warmup_steps + 1)))


def fused_adamw(params: list[Tensor]) -> bool:
    """AdamW's fused kernel (one kernel over all parameters) for plain fp32/bf16 parameters
    on the CPU or a GPU, where torch's default is the slower per-tensor `foreach` loop. Not
    for sharded (DTensor) parameters, which keep torch's default."""
    return bool(params) and all(
        type(p) is torch.nn.Parameter
        and p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.bfloat16)
        for p in params
    )
