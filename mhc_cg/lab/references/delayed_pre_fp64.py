"""DeepSeek-V4.1's mHC in plain fp64 torch, from the published equations: the oracle the model's
``arithmetic: v41`` is tested on (docs/design.md, "DeepSeek-V4.1's delayed pre").

Nothing here calls mhc_cg's mHC ops: the boundary, the entry, the head's fold, the mixes and
DeepSeek-V4's Sinkhorn (``hc_split_sinkhorn``) are written out again. F (attention, MLP), the
embeddings and the head are the model's own modules, on an fp64 copy: the equations under test
are the ones around F. No dropout (the reference is deterministic; the modes' dropout is tested
by their bit-identity to eager).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

EPS = 1e-6  # DeepSeek-V4's: the mixes' RMS, the pre-mix floor, every Sinkhorn sum


def sinkhorn(logits: Tensor, iterations: int) -> Tensor:
    """softmax over each row, + eps; the columns normalised; then ``iterations - 1`` rounds of
    rows and columns, each sum + eps."""
    m = torch.softmax(logits, dim=-1) + EPS
    m = m / (m.sum(-2, keepdim=True) + EPS)
    for _ in range(iterations - 1):
        m = m / (m.sum(-1, keepdim=True) + EPS)
        m = m / (m.sum(-2, keepdim=True) + EPS)
    return m


def coefficients(streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int,
                 iterations: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(pre [T, n], post [T, n], comb [T, n, n])`` of a site from its input ``[T, n*C]``."""
    mix = (streams @ fn.t()) * torch.rsqrt(streams.pow(2).mean(-1, keepdim=True) + EPS)
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + EPS
    post = 2.0 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = sinkhorn((mix[:, 2 * n:] * scale[2] + base[2 * n:]).view(-1, n, n), iterations)
    return pre, post, comb


def collapse(streams: Tensor, pre_mix: Tensor, weight: Tensor, eps: float, n: int) -> Tensor:
    """``c = sum_j q[j] X_j``, then its RMSNorm ``c * rsqrt(mean(c^2) + eps) * w``."""
    c = (pre_mix[:, :, None] * streams.view(streams.shape[0], n, -1)).sum(1)
    return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * weight


def residual_update(streams: Tensor, post: Tensor, comb: Tensor, f_out: Tensor, n: int) -> Tensor:
    """``X'_j = post[j] * F + sum_i comb[i, j] * X_i``."""
    x = streams.view(streams.shape[0], n, -1)
    mixed = torch.einsum("tij,tic->tjc", comb, x)
    return (post[:, :, None] * f_out[:, None, :] + mixed).flatten(1)


def forward(model: nn.Module, input_ids: Tensor) -> Tensor:
    """The logits ``[b, s, vocab]`` of ``model`` (an fp64 :class:`~mhc_cg.model.MHCGPT` of
    ``arithmetic: v41``; see :func:`fp64_copy`) computed by the equations above."""
    cfg = model.cfg
    n, (b, s) = cfg.num_streams, input_ids.shape
    h = model.embedding(input_ids) + model.position(torch.arange(s))
    h = h.transpose(0, 1).reshape(s * b, -1)  # tokens in the model's [s, b] order
    streams = h.repeat(1, n)
    pre_mix = torch.zeros(s * b, n, dtype=h.dtype)
    pre_mix[:, 0] = 1.0  # the entry: the first input is stream 0
    for layer in model.layers:
        for sub in (layer.attention, layer.mlp):
            hc = sub.hc
            scale = torch.cat([hc.alpha_pre, hc.alpha_post, hc.alpha_res])
            pre, post, comb = coefficients(streams, hc.mapping_proj.weight, scale, hc.bias, n,
                                           cfg.sinkhorn_iterations)
            f_in = collapse(streams, pre_mix, sub.norm.weight, sub.norm.eps, n)
            f_out = sub.fn(f_in.view(s, b, -1)).reshape(s * b, -1)
            streams, pre_mix = residual_update(streams, post, comb, f_out, n), pre
    folded = (pre_mix[:, :, None] * streams.view(s * b, n, -1)).sum(1)
    normed = folded * torch.rsqrt(folded.pow(2).mean(-1, keepdim=True) + model.final_norm.eps)
    logits = (normed * model.final_norm.weight) @ model.head.weight.t()
    return logits.view(s, b, -1).transpose(0, 1)


def fp64_copy(model: nn.Module) -> nn.Module:
    """An fp64 copy of ``model`` in eval (no dropout), its F on torch's kernels."""
    ref = copy.deepcopy(model).double().eval()
    for module in ref.modules():
        if hasattr(module, "kernels"):
            module.kernels = "torch"
    return ref
