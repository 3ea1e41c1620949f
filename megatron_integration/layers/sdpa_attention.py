"""A core attention for megatron layers on the CPU: ``DotProductAttention``'s interface on SDPA.

megatron-core's ``DotProductAttention`` takes its score buffer from a global buffer on
``torch.cuda.current_device()`` and forks megatron's CUDA RNG tracker, whose state check reads a
host value: neither runs on a CPU build of torch, and the second cannot be captured on the tape.
Layer specs swap it for ``SDPACoreAttention`` on the CPU (``get_mhc_layer_spec(cpu_attention=True)``,
``main_mhc_layer_spec(cpu_attention=True)``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """A core attention with ``DotProductAttention``'s interface on ``F.scaled_dot_product_attention``.

    ``query/key/value [s, b, heads, head_dim] -> [s, b, heads * head_dim]``; causal when no mask
    is given and the mask type is causal; ``attention_mask`` is megatron's boolean "masked out".
    Runs on any device (no tensor parallelism, no packed sequences).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None,
                packed_seq_params=None) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: no attention bias or packed sequences")
        if key.shape[2] != query.shape[2]:  # grouped-query attention
            repeat = query.shape[2] // key.shape[2]
            key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask_type = attn_mask_type or self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
            dropout_p=self.dropout_p if self.training else 0.0, is_causal=causal,
            scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
