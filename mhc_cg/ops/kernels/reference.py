"""The fused mHC ops in plain torch: the CPU path and the oracle the Triton kernels are tested on.

Every function takes token-major 2-D views (T tokens; the callers in ``mhc_cg.ops.kernels.ops``
flatten ``[s, b, ...]``) and computes in fp32, or fp64 for fp64 inputs, casting the results to
the input dtype, exactly as the Triton kernels do. Backward functions are the explicit
derivatives (no autograd inside): the same formulas the kernels implement.

Shapes: ``proj [T, n*n+2n]`` (columns ``[pre | post | res]``), ``xnorm [T]`` (the L2 norm of the
token's ``n*C`` features), ``x [T, n*C]`` stream-major, ``y [T, C]``, ``h_pre``/``h_post [T, n]``,
``h_res [T, n, n]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhc_cg.ops.kernels.hash import counter_hash, keep_bits, keep_threshold, keep_scale, seed32

SINKHORN_EPS = 1e-6
RMS_EPS = 1e-6


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ---- mappings --------------------------------------------------------------------------------

def _scale(a_pre: Tensor, a_post: Tensor, a_res: Tensor, n: int, acc: torch.dtype) -> Tensor:
    return torch.cat([a_pre.expand(n), a_post.expand(n), a_res.expand(n * n)]).to(acc)


def _logits(proj: Tensor, xnorm: Tensor, a_pre, a_post, a_res, bias, n: int, sqrt_d: float):
    """``h = r * proj * scale + bias`` with ``r = 1 / (xnorm / sqrt_d + eps)``; returns (h, r, p, scale)."""
    acc = compute_dtype(proj.dtype)
    p = proj.to(acc)
    r = 1.0 / (xnorm.to(acc) / sqrt_d + RMS_EPS)
    scale = _scale(a_pre, a_post, a_res, n, acc)
    return r[:, None] * p * scale + bias.to(acc), r, p, scale


def sinkhorn_init(logits: Tensor) -> Tensor:
    return torch.exp(logits - logits.amax(dim=-1, keepdim=True))


def _normalise(m: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``(m / max(sum(m, dim), eps), sum(m, dim))``."""
    s = m.sum(dim=dim, keepdim=True)
    return m / s.clamp_min(SINKHORN_EPS), s


def _normalise_backward(g: Tensor, out: Tensor, s: Tensor, dim: int) -> Tensor:
    """Gradient through ``out = m / max(s, eps)``, ``s = sum(m, dim)``: no path through a clamped ``s``."""
    through = (g * out).sum(dim=dim, keepdim=True) * (s >= SINKHORN_EPS)
    return (g - through) / s.clamp_min(SINKHORN_EPS)


def sinkhorn(logits: Tensor, iterations: int) -> Tensor:
    """Row then column normalisation, ``iterations`` times, from ``exp(L - rowmax)``."""
    m = sinkhorn_init(logits)
    for _ in range(iterations):
        m = _normalise(m, -1)[0]
        m = _normalise(m, -2)[0]
    return m


def sinkhorn_backward(logits: Tensor, grad: Tensor, iterations: int) -> Tensor:
    """d sinkhorn / d logits, recomputing the iterates from the logits (kept only inside this call)."""
    m0 = sinkhorn_init(logits)
    steps = []  # (out, s, dim) of every half-step, in order
    m = m0
    for _ in range(iterations):
        for dim in (-1, -2):
            out, s = _normalise(m, dim)
            steps.append((out, s, dim))
            m = out
    g = grad
    for out, s, dim in reversed(steps):
        g = _normalise_backward(g, out, s, dim)
    # m0 = exp(L - max): the max's share goes to the maxima, split evenly between ties (as amax's)
    g_l = g * m0
    is_max = logits == logits.amax(dim=-1, keepdim=True)
    g_max = -g_l.sum(dim=-1, keepdim=True)
    return g_l + is_max * (g_max / is_max.sum(dim=-1, keepdim=True))


def mappings(proj: Tensor, xnorm: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
             bias: Tensor, n: int, iterations: int, sqrt_d: float) -> tuple[Tensor, Tensor, Tensor]:
    h, _, _, _ = _logits(proj, xnorm, a_pre, a_post, a_res, bias, n, sqrt_d)
    h_pre = torch.sigmoid(h[:, :n])
    h_post = 2.0 * torch.sigmoid(h[:, n:2 * n])
    h_res = sinkhorn(h[:, 2 * n:].unflatten(-1, (n, n)), iterations)
    dtype = proj.dtype
    return h_pre.to(dtype), h_post.to(dtype), h_res.to(dtype)


def mappings_partials(g_pre: Tensor, g_post: Tensor, g_res: Tensor, proj: Tensor, xnorm: Tensor,
                      a_pre: Tensor, a_post: Tensor, a_res: Tensor, bias: Tensor, n: int,
                      iterations: int, sqrt_d: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per token: ``g_proj [T, m]``, ``g_xnorm [T]`` and ``partial [T, m + 3]``, the token's share
    of the parameter gradients (``g_bias`` then ``g_alpha_pre, g_alpha_post, g_alpha_res``)."""
    h, r, p, scale = _logits(proj, xnorm, a_pre, a_post, a_res, bias, n, sqrt_d)
    acc = h.dtype
    s_pre, s_post = torch.sigmoid(h[:, :n]), torch.sigmoid(h[:, n:2 * n])
    g_h = torch.cat([
        g_pre.to(acc) * s_pre * (1.0 - s_pre),
        g_post.to(acc) * 2.0 * s_post * (1.0 - s_post),
        sinkhorn_backward(h[:, 2 * n:].unflatten(-1, (n, n)), g_res.to(acc), iterations).flatten(1),
    ], dim=1)
    g_proj = g_h * scale * r[:, None]
    g_r = (g_h * scale * p).sum(dim=1)
    g_xnorm = g_r * (-r * r / sqrt_d)
    g_scale = g_h * r[:, None] * p
    alphas = torch.stack([g_scale[:, :n].sum(1), g_scale[:, n:2 * n].sum(1), g_scale[:, 2 * n:].sum(1)], 1)
    return g_proj.to(proj.dtype), g_xnorm.to(xnorm.dtype), torch.cat([g_h, alphas], dim=1)


# ---- aggregate, h_res, post + bias-dropout-add -------------------------------------------------

def aggregate(x: Tensor, h_pre: Tensor, n: int) -> Tensor:
    acc = compute_dtype(x.dtype)
    xv = x.to(acc).unflatten(1, (n, -1))
    return (h_pre.to(acc)[:, :, None] * xv).sum(1).to(x.dtype)


def aggregate_backward(g: Tensor, x: Tensor, h_pre: Tensor, n: int) -> tuple[Tensor, Tensor]:
    acc = compute_dtype(x.dtype)
    xv, ga = x.to(acc).unflatten(1, (n, -1)), g.to(acc)
    g_x = (h_pre.to(acc)[:, :, None] * ga[:, None, :]).flatten(1)
    g_h = (xv * ga[:, None, :]).sum(-1)
    return g_x.to(x.dtype), g_h.to(h_pre.dtype)


def h_res_apply(h_res: Tensor, x: Tensor) -> Tensor:
    n = h_res.shape[-1]
    acc = compute_dtype(x.dtype)
    out = torch.matmul(h_res.to(acc), x.to(acc).unflatten(1, (n, -1)))
    return out.flatten(1).to(x.dtype)


def h_res_apply_backward(g: Tensor, h_res: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    n = h_res.shape[-1]
    acc = compute_dtype(x.dtype)
    gv, xv, h = g.to(acc).unflatten(1, (n, -1)), x.to(acc).unflatten(1, (n, -1)), h_res.to(acc)
    g_h = torch.matmul(gv, xv.transpose(1, 2))
    g_x = torch.matmul(h.transpose(1, 2), gv).flatten(1)
    return g_h.to(h_res.dtype), g_x.to(x.dtype)


def dropout_keep_scaled(seed: Tensor | None, stream: int, p: float, t: int, width: int,
                        device: torch.device) -> Tensor | None:
    """``keep / (1 - p)`` (fp32) for the ``[t, width]`` output, or None without dropout."""
    if seed is None or p == 0.0:
        return None
    index = torch.arange(t * width, dtype=torch.int32, device=device).view(t, width)
    keep = keep_bits(counter_hash(seed32(seed), stream, index)) >= keep_threshold(p)
    return keep.to(torch.float32) * keep_scale(p)


def post_bda(y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None, p: float,
             stream: int) -> Tensor:
    """``mixed[i] + dropout(h_post[i] * y)`` over the n streams."""
    t, n = h_post.shape
    acc = compute_dtype(mixed.dtype)
    post = (h_post.to(acc)[:, :, None] * y.to(acc)[:, None, :]).flatten(1)
    mask = dropout_keep_scaled(seed, stream, p, t, mixed.shape[1], mixed.device)
    if mask is not None:
        post = post * mask.to(acc)
    return (mixed.to(acc) + post).to(mixed.dtype)


def post_bda_backward(g: Tensor, y: Tensor, h_post: Tensor, seed: Tensor | None, p: float,
                      stream: int) -> tuple[Tensor, Tensor]:
    """``(g_y, g_h_post)``; the gradient of ``mixed`` is ``g`` itself."""
    t, n = h_post.shape
    acc = compute_dtype(g.dtype)
    ga = g.to(acc)
    mask = dropout_keep_scaled(seed, stream, p, t, g.shape[1], g.device)
    if mask is not None:
        ga = ga * mask.to(acc)
    gv = ga.unflatten(1, (n, -1))
    g_y = (h_post.to(acc)[:, :, None] * gv).sum(1)
    g_h = (gv * y.to(acc)[:, None, :]).sum(-1)
    return g_y.to(y.dtype), g_h.to(h_post.dtype)


# ---- RMSNorm (the sublayer's norm) ----------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dim of ``x [T, C]``."""
    acc = compute_dtype(x.dtype)
    xa = x.to(acc)
    rstd = torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    return (xa * rstd * weight.to(acc)).to(x.dtype)


def rms_norm_backward(g: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(g_x, g_weight)``; the scale is recomputed from ``x`` (nothing but x and weight is saved)."""
    acc = compute_dtype(x.dtype)
    xa, ga, w = x.to(acc), g.to(acc), weight.to(acc)
    rstd = torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xa * rstd
    g_xhat = ga * w
    g_x = rstd * (g_xhat - xhat * (g_xhat * xhat).mean(-1, keepdim=True))
    return g_x.to(x.dtype), (ga * xhat).sum(0).to(weight.dtype)
