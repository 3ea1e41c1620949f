"""Attention on ``meta`` as a GPU runs it: one fused kernel, not the math path.

On ``meta`` (and on any device without a fused kernel) ``scaled_dot_product_attention`` falls back
to the math path, which materialises the seq x seq scores and saves them for backward. A GPU picks a
fused kernel: flash attention for fp16/bf16, memory-efficient attention for fp32. Costing the
benchmark shape on ``meta`` with the math path would charge every graph that memory, so within
:func:`fused_attention_on_meta` causal attention without a mask on ``meta`` tensors calls the
fused aten op directly (it has meta kernels and a backward): one kernel forward, one backward, and
the log-sum-exp it saves.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _fused(original):
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, scale=None, enable_gqa=False):
        if (query.device.type != "meta" or attn_mask is not None or dropout_p != 0.0
                or enable_gqa):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if query.dtype in (torch.float16, torch.bfloat16):
            return aten._scaled_dot_product_flash_attention(
                query, key, value, 0.0, is_causal, False, scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, 0.0, is_causal, scale=scale)[0]
    return scaled_dot_product_attention


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """Route ``F.scaled_dot_product_attention`` on meta tensors to the fused kernel a GPU uses."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused(original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
