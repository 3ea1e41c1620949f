"""Triton kernels of the fused mHC ops; the same signatures as ``mhc_cg.ops.kernels.reference``.

Loaded by ``mhc_cg.ops.kernels.dispatch.triton_kernels()`` only (so ``import mhc_cg`` never needs
triton). Every kernel computes in fp32 and stores in the output's dtype. Tensors are token-major
and made contiguous (a no-op for the model's); the stream axis is padded to a power of two ``NP``
and masked.

* ``mappings``: ``BT`` tokens per program; Sinkhorn on a ``[BT, NP, NP]`` register tile. The
  backward recomputes the iterates from the logits: iteration k's input is rebuilt by k forward
  iterations, so T iterations cost T*(T+1)/2 in registers and nothing is stored.
* ``aggregate``/``h_res_apply``/``post_bda`` forwards: one program per (token, block of C).
  Their backwards: one program per token, looping over C, so the per-token reductions
  (``g_h_pre``, ``g_h_res``, ``g_h_post``) need no atomics and are deterministic.
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl
from triton import knobs

from mhc_cg.ops.kernels.hash import MAX_ELEMENTS, counter_hash, keep_scale, keep_threshold
from mhc_cg.ops.kernels.reference import RMS_EPS, SINKHORN_EPS

INTERPRETED = bool(knobs.runtime.interpret)

# The very function torch runs for mhc_cg.ops.dropout, jitted from its source. Triton's interpreter
# wants triton.language among the function's globals; the hash itself reads no global.
_hash = triton.jit(types.FunctionType(counter_hash.__code__, {**counter_hash.__globals__, "tl": tl},
                                      counter_hash.__name__))


def _np(n: int) -> int:
    return triton.next_power_of_2(n)


def _block_c(c: int) -> int:
    return min(triton.next_power_of_2(c), 1024)


def _prepared(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors, contiguous (a no-op for the model's tensors), checked for int32 indexing."""
    for t in tensors:
        if t.numel() > MAX_ELEMENTS:
            raise ValueError(f"mhc_cg triton kernels index with int32: at most {MAX_ELEMENTS} elements")
    return [t.contiguous() for t in tensors]


# ---- Sinkhorn on a [BT, NP, NP] tile -----------------------------------------------------------

@triton.jit
def _sk_init(logits, mask):
    """``exp(L - rowmax)`` on valid entries, 0 on padding."""
    lmax = tl.max(tl.where(mask, logits, float("-inf")), axis=2)
    row_valid = tl.sum(mask.to(tl.int32), axis=2) > 0
    lmax = tl.where(row_valid, lmax, 0.0)
    return tl.where(mask, tl.exp(tl.where(mask, logits, 0.0) - lmax[:, :, None]), 0.0)


@triton.jit
def _sk_iteration(m, EPS: tl.constexpr):
    m = m / tl.maximum(tl.sum(m, axis=2), EPS)[:, :, None]
    return m / tl.maximum(tl.sum(m, axis=1), EPS)[:, None, :]


@triton.jit
def _load_logits(proj_ptr, bias_ptr, ares_ptr, r, t, tmask, N: tl.constexpr, NP: tl.constexpr):
    M: tl.constexpr = N * N + 2 * N
    i = tl.arange(0, NP)
    col = 2 * N + i[:, None] * N + i[None, :]  # [NP, NP]
    valid = (i[:, None] < N) & (i[None, :] < N)
    mask = tmask[:, None, None] & valid[None, :, :]
    p = tl.load(proj_ptr + t[:, None, None] * M + col[None, :, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + col, mask=valid, other=0.0).to(tl.float32)
    a = tl.load(ares_ptr).to(tl.float32)
    return r[:, None, None] * p * a + b[None, :, :], p, mask, col


@triton.jit
def _mappings_fwd(proj_ptr, xnorm_ptr, apre_ptr, apost_ptr, ares_ptr, bias_ptr,
                  pre_ptr, post_ptr, res_ptr, T, sqrt_d, iterations,
                  N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                  EPS: tl.constexpr, RMS: tl.constexpr):
    M: tl.constexpr = N * N + 2 * N
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    r = 1.0 / (tl.load(xnorm_ptr + t, mask=tmask, other=1.0).to(tl.float32) / sqrt_d + RMS)
    i = tl.arange(0, NP)
    vmask = tmask[:, None] & (i[None, :] < N)
    p_pre = tl.load(proj_ptr + t[:, None] * M + i[None, :], mask=vmask, other=0.0).to(tl.float32)
    p_post = tl.load(proj_ptr + t[:, None] * M + N + i[None, :], mask=vmask, other=0.0).to(tl.float32)
    b_pre = tl.load(bias_ptr + i, mask=i < N, other=0.0).to(tl.float32)
    b_post = tl.load(bias_ptr + N + i, mask=i < N, other=0.0).to(tl.float32)
    h_pre = r[:, None] * p_pre * tl.load(apre_ptr).to(tl.float32) + b_pre[None, :]
    h_post = r[:, None] * p_post * tl.load(apost_ptr).to(tl.float32) + b_post[None, :]
    tl.store(pre_ptr + t[:, None] * N + i[None, :], 1.0 / (1.0 + tl.exp(-h_pre)), mask=vmask)
    tl.store(post_ptr + t[:, None] * N + i[None, :], 2.0 / (1.0 + tl.exp(-h_post)), mask=vmask)

    logits, _, mask, _ = _load_logits(proj_ptr, bias_ptr, ares_ptr, r, t, tmask, N, NP)
    m = _sk_init(logits, mask)
    for _ in range(iterations):
        m = _sk_iteration(m, EPS)
    out = t[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
    tl.store(res_ptr + out, m, mask=mask)


@triton.jit
def _mappings_bwd(gpre_ptr, gpost_ptr, gres_ptr, proj_ptr, xnorm_ptr, apre_ptr, apost_ptr,
                  ares_ptr, bias_ptr, gproj_ptr, gxnorm_ptr, partial_ptr, T, sqrt_d, iterations,
                  N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                  EPS: tl.constexpr, RMS: tl.constexpr):
    M: tl.constexpr = N * N + 2 * N
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    r = 1.0 / (tl.load(xnorm_ptr + t, mask=tmask, other=1.0).to(tl.float32) / sqrt_d + RMS)
    i = tl.arange(0, NP)
    vmask = tmask[:, None] & (i[None, :] < N)
    a_pre = tl.load(apre_ptr).to(tl.float32)
    a_post = tl.load(apost_ptr).to(tl.float32)
    a_res = tl.load(ares_ptr).to(tl.float32)

    # sigmoid parts
    p_pre = tl.load(proj_ptr + t[:, None] * M + i[None, :], mask=vmask, other=0.0).to(tl.float32)
    p_post = tl.load(proj_ptr + t[:, None] * M + N + i[None, :], mask=vmask, other=0.0).to(tl.float32)
    s_pre = 1.0 / (1.0 + tl.exp(-(r[:, None] * p_pre * a_pre
                                  + tl.load(bias_ptr + i, mask=i < N, other=0.0).to(tl.float32)[None, :])))
    s_post = 1.0 / (1.0 + tl.exp(-(r[:, None] * p_post * a_post
                                   + tl.load(bias_ptr + N + i, mask=i < N, other=0.0).to(tl.float32)[None, :])))
    g_pre = tl.load(gpre_ptr + t[:, None] * N + i[None, :], mask=vmask, other=0.0).to(tl.float32)
    g_post = tl.load(gpost_ptr + t[:, None] * N + i[None, :], mask=vmask, other=0.0).to(tl.float32)
    gh_pre = g_pre * s_pre * (1.0 - s_pre)
    gh_post = g_post * 2.0 * s_post * (1.0 - s_post)

    # Sinkhorn, backwards through the iterations, each input rebuilt from the logits
    logits, p_res, mask, col = _load_logits(proj_ptr, bias_ptr, ares_ptr, r, t, tmask, N, NP)
    gidx = t[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
    g = tl.load(gres_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    m0 = _sk_init(logits, mask)
    for k in range(iterations):
        m = m0
        for _ in range(iterations - 1 - k):
            m = _sk_iteration(m, EPS)
        s_row = tl.sum(m, axis=2)
        c_row = tl.maximum(s_row, EPS)
        mid = m / c_row[:, :, None]
        s_col = tl.sum(mid, axis=1)
        c_col = tl.maximum(s_col, EPS)
        out = mid / c_col[:, None, :]
        through = tl.where(s_col >= EPS, tl.sum(g * out, axis=1), 0.0)
        g = (g - through[:, None, :]) / c_col[:, None, :]
        through = tl.where(s_row >= EPS, tl.sum(g * mid, axis=2), 0.0)
        g = tl.where(mask, (g - through[:, :, None]) / c_row[:, :, None], 0.0)  # padding stays 0
    g_l = g * m0
    lmax = tl.max(tl.where(mask, logits, float("-inf")), axis=2)
    is_max = mask & (logits == lmax[:, :, None])
    ties = tl.maximum(tl.sum(is_max.to(tl.float32), axis=2), 1.0)
    g_max = -tl.sum(g_l, axis=2) / ties
    gh_res = tl.where(is_max, g_l + g_max[:, :, None], g_l)

    # gradients of proj, xnorm and the token's share of bias/alpha
    P: tl.constexpr = M + 3
    tl.store(gproj_ptr + t[:, None] * M + i[None, :], gh_pre * a_pre * r[:, None], mask=vmask)
    tl.store(gproj_ptr + t[:, None] * M + N + i[None, :], gh_post * a_post * r[:, None], mask=vmask)
    tl.store(gproj_ptr + t[:, None, None] * M + col[None, :, :], gh_res * a_res * r[:, None, None],
             mask=mask)
    g_r = (tl.sum(gh_pre * a_pre * p_pre, axis=1) + tl.sum(gh_post * a_post * p_post, axis=1)
           + tl.sum(tl.sum(gh_res * a_res * p_res, axis=2), axis=1))
    tl.store(gxnorm_ptr + t, g_r * (-r * r / sqrt_d), mask=tmask)
    tl.store(partial_ptr + t[:, None] * P + i[None, :], gh_pre, mask=vmask)
    tl.store(partial_ptr + t[:, None] * P + N + i[None, :], gh_post, mask=vmask)
    tl.store(partial_ptr + t[:, None, None] * P + col[None, :, :], gh_res, mask=mask)
    tl.store(partial_ptr + t * P + M, tl.sum(gh_pre * r[:, None] * p_pre, axis=1), mask=tmask)
    tl.store(partial_ptr + t * P + M + 1, tl.sum(gh_post * r[:, None] * p_post, axis=1), mask=tmask)
    tl.store(partial_ptr + t * P + M + 2,
             tl.sum(tl.sum(gh_res * r[:, None, None] * p_res, axis=2), axis=1), mask=tmask)


_BT = 16


def mappings(proj, xnorm, a_pre, a_post, a_res, bias, n, iterations, sqrt_d):
    proj, xnorm = _prepared(proj, xnorm)
    t = proj.shape[0]
    h_pre, h_post = proj.new_empty(t, n), proj.new_empty(t, n)
    h_res = proj.new_empty(t, n, n)
    _mappings_fwd[(triton.cdiv(t, _BT),)](
        proj, xnorm, a_pre, a_post, a_res, bias, h_pre, h_post, h_res, t, float(sqrt_d), iterations,
        N=n, NP=_np(n), BT=_BT, EPS=SINKHORN_EPS, RMS=RMS_EPS)
    return h_pre, h_post, h_res


def mappings_partials(g_pre, g_post, g_res, proj, xnorm, a_pre, a_post, a_res, bias, n,
                      iterations, sqrt_d):
    g_pre, g_post, g_res, proj, xnorm = _prepared(g_pre, g_post, g_res, proj, xnorm)
    t, m = proj.shape
    g_proj, g_xnorm = torch.empty_like(proj), torch.empty_like(xnorm)
    partial = proj.new_empty(t, m + 3, dtype=torch.float32)
    _mappings_bwd[(triton.cdiv(t, _BT),)](
        g_pre, g_post, g_res, proj, xnorm, a_pre, a_post, a_res, bias, g_proj, g_xnorm, partial,
        t, float(sqrt_d), iterations, N=n, NP=_np(n), BT=_BT, EPS=SINKHORN_EPS, RMS=RMS_EPS)
    return g_proj, g_xnorm, partial


# ---- aggregate ----------------------------------------------------------------------------------

@triton.jit
def _aggregate_fwd(x_ptr, h_ptr, out_ptr, C, N: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    i = tl.arange(0, NP)
    cmask = c < C
    h = tl.load(h_ptr + t * N + i, mask=i < N, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t * N * C + i[:, None] * C + c[None, :],
                mask=(i[:, None] < N) & cmask[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + t * C + c, tl.sum(h[:, None] * x, axis=0), mask=cmask)


@triton.jit
def _aggregate_bwd(g_ptr, x_ptr, h_ptr, gx_ptr, gh_ptr, C, N: tl.constexpr, NP: tl.constexpr,
                   BC: tl.constexpr):
    t = tl.program_id(0)
    i = tl.arange(0, NP)
    h = tl.load(h_ptr + t * N + i, mask=i < N, other=0.0).to(tl.float32)
    gh = tl.zeros([NP], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        mask = (i[:, None] < N) & (c < C)[None, :]
        g = tl.load(g_ptr + t * C + c, mask=c < C, other=0.0).to(tl.float32)
        off = t * N * C + i[:, None] * C + c[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        tl.store(gx_ptr + off, h[:, None] * g[None, :], mask=mask)
        gh += tl.sum(x * g[None, :], axis=1)
    tl.store(gh_ptr + t * N + i, gh, mask=i < N)


def aggregate(x, h_pre, n):
    x, h_pre = _prepared(x, h_pre)
    t, width = x.shape
    c = width // n
    out = x.new_empty(t, c)
    bc = _block_c(c)
    _aggregate_fwd[(t, triton.cdiv(c, bc))](x, h_pre, out, c, N=n, NP=_np(n), BC=bc)
    return out


def aggregate_backward(g, x, h_pre, n):
    g, x, h_pre = _prepared(g, x, h_pre)
    t, width = x.shape
    c = width // n
    g_x, g_h = torch.empty_like(x), torch.empty_like(h_pre)
    _aggregate_bwd[(t,)](g, x, h_pre, g_x, g_h, c, N=n, NP=_np(n), BC=_block_c(c))
    return g_x, g_h


# ---- h_res --------------------------------------------------------------------------------------

@triton.jit
def _h_res_fwd(h_ptr, x_ptr, out_ptr, C, N: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    i = tl.arange(0, NP)
    cmask = c < C
    h = tl.load(h_ptr + t * N * N + i[:, None] * N + i[None, :],
                mask=(i[:, None] < N) & (i[None, :] < N), other=0.0).to(tl.float32)
    mask = (i[:, None] < N) & cmask[None, :]
    off = t * N * C + i[:, None] * C + c[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)  # [j, c]
    tl.store(out_ptr + off, tl.sum(h[:, :, None] * x[None, :, :], axis=1), mask=mask)


@triton.jit
def _h_res_bwd(g_ptr, h_ptr, x_ptr, gh_ptr, gx_ptr, C, N: tl.constexpr, NP: tl.constexpr,
               BC: tl.constexpr):
    t = tl.program_id(0)
    i = tl.arange(0, NP)
    hmask = (i[:, None] < N) & (i[None, :] < N)
    h = tl.load(h_ptr + t * N * N + i[:, None] * N + i[None, :], mask=hmask, other=0.0).to(tl.float32)
    gh = tl.zeros([NP, NP], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        mask = (i[:, None] < N) & (c < C)[None, :]
        off = t * N * C + i[:, None] * C + c[None, :]
        g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)  # [i, c]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)  # [j, c]
        tl.store(gx_ptr + off, tl.sum(h[:, :, None] * g[:, None, :], axis=0), mask=mask)
        gh += tl.sum(g[:, None, :] * x[None, :, :], axis=2)
    tl.store(gh_ptr + t * N * N + i[:, None] * N + i[None, :], gh, mask=hmask)


def _block_c_3d(c: int, n: int) -> int:
    return max(16, min(_block_c(c), 4096 // (_np(n) * _np(n))))


def h_res_apply(h_res, x):
    h_res, x = _prepared(h_res, x)
    t, width = x.shape
    n = h_res.shape[-1]
    c = width // n
    out = torch.empty_like(x)
    bc = _block_c_3d(c, n)
    _h_res_fwd[(t, triton.cdiv(c, bc))](h_res, x, out, c, N=n, NP=_np(n), BC=bc)
    return out


def h_res_apply_backward(g, h_res, x):
    g, h_res, x = _prepared(g, h_res, x)
    t, width = x.shape
    n = h_res.shape[-1]
    c = width // n
    g_h, g_x = torch.empty_like(h_res), torch.empty_like(x)
    _h_res_bwd[(t,)](g, h_res, x, g_h, g_x, c, N=n, NP=_np(n), BC=_block_c_3d(c, n))
    return g_h, g_x


# ---- h_post + bias-dropout-add --------------------------------------------------------------------

@triton.jit
def _keep_scaled(seed_ptr, stream, index, THRESHOLD: tl.constexpr, SCALE: tl.constexpr):
    seed = tl.load(seed_ptr).to(tl.int32)
    bits = (_hash(seed, stream, index) >> 8) & 0xFFFFFF
    return tl.where(bits >= THRESHOLD, SCALE, 0.0)


@triton.jit
def _post_bda_fwd(y_ptr, h_ptr, mixed_ptr, seed_ptr, out_ptr, stream, C,
                  N: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, DROPOUT: tl.constexpr,
                  THRESHOLD: tl.constexpr, SCALE: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    i = tl.arange(0, NP)
    mask = (i[:, None] < N) & (c < C)[None, :]
    h = tl.load(h_ptr + t * N + i, mask=i < N, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * C + c, mask=c < C, other=0.0).to(tl.float32)
    off = t * N * C + i[:, None] * C + c[None, :]
    post = h[:, None] * y[None, :]
    if DROPOUT:
        post = post * _keep_scaled(seed_ptr, stream, off, THRESHOLD, SCALE)
    mixed = tl.load(mixed_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, mixed + post, mask=mask)


@triton.jit
def _post_bda_bwd(g_ptr, y_ptr, h_ptr, seed_ptr, gy_ptr, gh_ptr, stream, C,
                  N: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, DROPOUT: tl.constexpr,
                  THRESHOLD: tl.constexpr, SCALE: tl.constexpr):
    t = tl.program_id(0)
    i = tl.arange(0, NP)
    h = tl.load(h_ptr + t * N + i, mask=i < N, other=0.0).to(tl.float32)
    gh = tl.zeros([NP], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        mask = (i[:, None] < N) & (c < C)[None, :]
        off = t * N * C + i[:, None] * C + c[None, :]
        g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            g = g * _keep_scaled(seed_ptr, stream, off, THRESHOLD, SCALE)
        y = tl.load(y_ptr + t * C + c, mask=c < C, other=0.0).to(tl.float32)
        tl.store(gy_ptr + t * C + c, tl.sum(h[:, None] * g, axis=0), mask=c < C)
        gh += tl.sum(g * y[None, :], axis=1)
    tl.store(gh_ptr + t * N + i, gh, mask=i < N)


def _dropout_args(seed, p):
    # The hash wraps its int32 products on purpose: keep Triton's debug-mode overflow check off.
    dropout = seed is not None and p > 0.0
    return dict(DROPOUT=dropout, THRESHOLD=keep_threshold(p) if dropout else 0,
                SCALE=keep_scale(p) if dropout else 1.0, sanitize_overflow=False)


def post_bda(y, h_post, mixed, seed, p, stream):
    y, h_post, mixed = _prepared(y, h_post, mixed)
    t, n = h_post.shape
    c = y.shape[1]
    out = torch.empty_like(mixed)
    bc = _block_c(c)
    seed_arg = seed if seed is not None else mixed  # never read without dropout
    _post_bda_fwd[(t, triton.cdiv(c, bc))](y, h_post, mixed, seed_arg, out, stream, c, N=n,
                                            NP=_np(n), BC=bc, **_dropout_args(seed, p))
    return out


def post_bda_backward(g, y, h_post, seed, p, stream):
    g, y, h_post = _prepared(g, y, h_post)
    t, n = h_post.shape
    c = y.shape[1]
    g_y, g_h = torch.empty_like(y), torch.empty_like(h_post)
    seed_arg = seed if seed is not None else g
    _post_bda_bwd[(t,)](g, y, h_post, seed_arg, g_y, g_h, stream, c, N=n, NP=_np(n),
                        BC=_block_c(c), **_dropout_args(seed, p))
    return g_y, g_h


# ---- RMSNorm --------------------------------------------------------------------------------------

@triton.jit
def _rms_fwd(x_ptr, w_ptr, out_ptr, C, eps, BC: tl.constexpr):
    t = tl.program_id(0)
    ss = tl.zeros([BC], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        x = tl.load(x_ptr + t * C + c, mask=c < C, other=0.0).to(tl.float32)
        ss += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / C + eps)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        x = tl.load(x_ptr + t * C + c, mask=c < C, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * C + c, x * rstd * w, mask=c < C)


@triton.jit
def _rms_bwd(g_ptr, x_ptr, w_ptr, gx_ptr, gw_part_ptr, T, C, eps, R: tl.constexpr, BC: tl.constexpr):
    """``R`` rows per program; writes g_x and the program's share of g_weight (one row of partials)."""
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    rmask = rows < T
    ss = tl.zeros([R], dtype=tl.float32)
    dot = tl.zeros([R], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        mask = rmask[:, None] & (c < C)[None, :]
        off = rows[:, None] * C + c[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
        dot += tl.sum(g * w[None, :] * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / C + eps)
    mean_gx = dot * rstd / C  # mean(g_xhat * xhat)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        mask = rmask[:, None] & (c < C)[None, :]
        off = rows[:, None] * C + c[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)
        xhat = x * rstd[:, None]
        gx = rstd[:, None] * (g * w[None, :] - xhat * mean_gx[:, None])
        tl.store(gx_ptr + off, gx, mask=mask)
        tl.store(gw_part_ptr + pid * C + c, tl.sum(g * xhat, axis=0), mask=c < C)


_RMS_ROWS = 16


def rms_norm(x, weight, eps):
    x, weight = _prepared(x, weight)
    t, c = x.shape
    out = torch.empty_like(x)
    _rms_fwd[(t,)](x, weight, out, c, float(eps), BC=_block_c(c))
    return out


def rms_norm_backward(g, x, weight, eps):
    g, x, weight = _prepared(g, x, weight)
    t, c = x.shape
    programs = triton.cdiv(t, _RMS_ROWS)
    g_x = torch.empty_like(x)
    part = x.new_empty(programs, c, dtype=torch.float32)
    _rms_bwd[(programs,)](g, x, weight, g_x, part, t, c, float(eps), R=_RMS_ROWS,
                          BC=min(_block_c(c), 256))
    return g_x, part.sum(0).to(weight.dtype)  # a fixed-order sum: deterministic
