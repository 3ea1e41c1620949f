"""Fused mHC kernels: one op per step, forward and backward, Triton on CUDA, torch on CPU.

The steps of an mHC sublayer (``mhc_cg.model``) map onto four custom ops (``mhc_cg.ops.kernels.ops``):

* ``mappings``: from ``mapping_proj``'s output (the GEMM stays in cuBLAS) and the norm of x to
  h_pre, h_post and h_res, with Sinkhorn's iterations per token in registers; the backward
  recomputes the iterations from the logits;
* ``aggregate``: ``sum_i h_pre[i] * x[i]``;
* ``h_res_apply``: ``mixed[i] = sum_j h_res[i, j] * x[j]``;
* ``post_bda``: ``mixed[i] + dropout(h_post[i] * y)``, the mask drawn in-kernel from
  ``counter_hash(seed, stream, index)`` and drawn again in the backward (no mask is saved);
* ``rms_norm``: the sublayer's RMSNorm (and the final norm), the scale recomputed in the backward.

These wrappers take the model's ``[s, b, ...]`` tensors and a ``kernels`` choice
(``auto | torch | triton``, see ``mhc_cg.ops.kernels.dispatch``).
"""

from __future__ import annotations

import math

from torch import Tensor

from mhc_cg.ops.kernels import ops
from mhc_cg.ops.kernels.dispatch import KERNELS, kernels_problem, use_triton

__all__ = ["KERNELS", "kernels_problem", "use_triton", "mappings", "aggregate", "h_res_apply",
           "post_bda", "rms_norm"]


def mappings(x: Tensor, proj: Tensor, alpha_pre: Tensor, alpha_post: Tensor, alpha_res: Tensor,
             bias: Tensor, n: int, iterations: int, kernels: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """``x [*, n*C]``, ``proj = mapping_proj(x) [*, n*n+2n]`` -> ``h_pre, h_post [*, n]``, ``h_res [*, n, n]``."""
    lead = x.shape[:-1]
    xnorm = x.norm(dim=-1).reshape(-1)
    h_pre, h_post, h_res = ops.mappings(proj.reshape(-1, proj.shape[-1]), xnorm, alpha_pre,
                                        alpha_post, alpha_res, bias, n, iterations,
                                        math.sqrt(x.shape[-1]), use_triton(kernels, x.device))
    return h_pre.view(*lead, n), h_post.view(*lead, n), h_res.view(*lead, n, n)


def aggregate(x: Tensor, h_pre: Tensor, kernels: str = "auto") -> Tensor:
    """``sum_i h_pre[i] * x[i]``: ``[*, n*C], [*, n] -> [*, C]``."""
    n = h_pre.shape[-1]
    out = ops.aggregate(x.reshape(-1, x.shape[-1]), h_pre.reshape(-1, n), use_triton(kernels, x.device))
    return out.view(*x.shape[:-1], x.shape[-1] // n)


def h_res_apply(h_res: Tensor, x: Tensor, kernels: str = "auto") -> Tensor:
    """``out[i] = sum_j h_res[i, j] * x[j]``: ``[*, n, n], [*, n*C] -> [*, n*C]``."""
    n = h_res.shape[-1]
    out = ops.h_res_apply(h_res.reshape(-1, n, n), x.reshape(-1, x.shape[-1]),
                          use_triton(kernels, x.device))
    return out.view(x.shape)


def post_bda(y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None, p: float, stream: int,
             kernels: str = "auto") -> Tensor:
    """``mixed[i] + dropout(h_post[i] * y)``: ``[*, C], [*, n], [*, n*C] -> [*, n*C]``.

    ``seed`` None or ``p == 0`` means no dropout. The mask is the one ``mhc_cg.ops.dropout`` draws for
    a ``[*, n*C]`` tensor with the same seed and stream.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    n = h_post.shape[-1]
    out = ops.post_bda(y.reshape(-1, y.shape[-1]), h_post.reshape(-1, n),
                       mixed.reshape(-1, mixed.shape[-1]), seed if p > 0 else None, float(p),
                       int(stream), use_triton(kernels, mixed.device))
    return out.view(mixed.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float, kernels: str = "auto") -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight``: ``[*, C], [C] -> [*, C]``."""
    out = ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, float(eps), use_triton(kernels, x.device))
    return out.view(x.shape)
