"""F's building blocks of the mHC GPT: RMSNorm, causal self-attention and the MLP."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhc_cg.config import MHCGPTConfig
from mhc_cg.ops import kernels as fused
from mhc_cg.ops.output_linear import OutputLinear


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2) + eps) * weight``, one fused op (``mhc_cg.ops.kernels.rms_norm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, kernels: str = "auto"):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return fused.rms_norm(x, self.weight, self.eps, self.kernels)


class CausalSelfAttention(nn.Module):
    """``[s, b, C] -> [s, b, C]``; the output projection writes into ``out`` where given (and it
    fits: :class:`~mhc_cg.ops.output_linear.OutputLinear`)."""

    def __init__(self, cfg: MHCGPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = OutputLinear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        s, b, c = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.num_heads, c // self.num_heads).permute(2, 1, 3, 0, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, s, d]
        return self.proj(attended.permute(2, 0, 1, 3).reshape(s, b, c), out)


class MLP(nn.Module):
    """``[s, b, C] -> [s, b, C]``: fc1 -> gelu -> fc2, fc2 writing into ``out`` where given.

    ``recompute_activation`` asks the runtime not to keep the gelu output (``ffn`` per token, the
    MLP's largest tensor) from the forward to the backward. How is the runtime's: an eager forward
    runs ``eager_recompute(mlp, x)``, given at construction
    (:func:`mhc_cg.recompute.block_recompute.recompute_activation_eagerly`: a checkpoint
    whose output is freed and recomputed before fc2's backward); the static-buffer runtime keeps
    the gelu output in an arena slot instead and never calls this forward for such an MLP.
    Without either the MLP keeps its activation.
    """

    def __init__(self, cfg: MHCGPTConfig, ffn_hidden_size: int | None = None,
                 recompute_activation: bool = False,
                 eager_recompute: Callable[["MLP", Tensor], Tensor] | None = None):
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or cfg.ffn_hidden_size
        self.fc1 = nn.Linear(cfg.hidden_size, ffn_hidden_size)
        self.fc2 = OutputLinear(ffn_hidden_size, cfg.hidden_size)
        self.recompute_activation = recompute_activation
        self.eager_recompute = eager_recompute if recompute_activation else None

    def forward(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        if self.eager_recompute is not None and torch.is_grad_enabled():
            return self.eager_recompute(self, x)
        return self.fc2(F.gelu(self.fc1(x)), out)


def writes_output_into(fn: nn.Module) -> bool:
    """Whether ``fn`` takes ``fn(x, out)``: F whose last Linear writes into a buffer given."""
    return isinstance(fn, (CausalSelfAttention, MLP))
