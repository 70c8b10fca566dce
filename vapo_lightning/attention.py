"""Attention for bf16 mixed precision on the CPU.

Under CPU autocast, SDPA runs in bf16, and torch's bf16 flash-attention *backward* on the CPU
is slower than the fp32 one: in one actor update of the TRL benchmark's shapes (64 × 183
tokens, 1 thread) it took 535 ms against 233 ms, and the whole update 1.86 s against 1.41 s
with attention in fp32 (`benchmarks/results/trl_bf16.md`). `SDPA` below is transformers'
SDPA attention, except that on the CPU, under autocast, while autograd records, it runs in
fp32 (faster there, and more accurate). Everywhere else (GPUs, fp32 training, no-grad
forwards such as decoding, whose bf16 forward is faster) it is transformers' own function.

`models._finish` selects it for every model whose attention is transformers' SDPA. The choice
is not saved with the model (`save_pretrained` writes no attention implementation).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["SDPA", "sdpa_fp32_backward_on_cpu"]

SDPA = "vapo_sdpa"


def sdpa_fp32_backward_on_cpu(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """(B, H, L, D) query, key and value -> (B, L, H, D) attention output, as transformers'
    `sdpa_attention_forward`; in fp32 on the CPU under autocast while autograd records."""
    if query.device.type == "cpu" and torch.is_grad_enabled() and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return sdpa_attention_forward(
                module, query.float(), key.float(), value.float(), attention_mask, **kwargs
            )
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(SDPA, sdpa_fp32_backward_on_cpu)
AttentionMaskInterface.register(SDPA, sdpa_mask)  # the same masks as "sdpa"
