"""Triton kernels of the fused mHC ops; the same signatures as ``mhc_cg.ops.kernels.reference``.

Loaded by ``mhc_cg.ops.kernels.dispatch.triton_kernels()`` only (so ``import mhc_cg`` never needs
triton). Every kernel computes in fp32 and stores in the output's dtype; the state is fp32. Each
stream is its own tile (Note [streams at their own offsets]); per-token tiles pad the streams to a
power of two ``NP`` and the mapping width ``m`` to ``MP`` (at least 16, as ``tl.dot`` wants), both
masked. No atomics: a parameter's gradient leaves a kernel as per-token or
per-program shares that torch sums in a fixed order, so every result is deterministic.

* ``_state_part`` then ``_state_sum`` (the pre's first pass): the first over (``BT`` tokens, 64 or
  128: Note [wide token tiles]; a split of the features) sums the projection ``x W^T`` (``tl.dot``
  on tensor cores: Note [TF32 products]) and the streams' Gram matrix
  over its features into fp32 rows; the second sums the splits in order and derives the norm of
  x and F's input's RMSNorm scale: the state ``[proj | xnorm | rstd]``. Enough splits that the
  grid fills the GPU (``ops.state_splits``). With ``POST`` the first is a post and the next
  pre's first pass in one (``post_state``): each tile of the post's output is made from the
  post's input and F's output, stored, and projected as stored, so the next pre reads its input
  once; one pair of kernels and one tiling, so the state is the same bits either way.
* ``_post_maps``: ``BT`` tokens per program and one post per ``program_id(1)``: the post's
  mappings ``[H_post / 2 | H_res]`` from the state, Sinkhorn once per token (not once per feature
  block of every chain program), written for ``_chain`` to read.
* ``_chain``: one program per ``BT`` tokens and ``BC`` features; for sublayer ``k = 0, 1, ...``
  F's input ``rstd * w * sum_i h_pre[i] x_k[i]`` (``FN``), then
  ``x_{k+1} = H_res x_k + dropout(H_post y_k)`` with the mappings ``_post_maps`` wrote, kept in
  registers (rounded to the stream's dtype, as the forward stores it) and written. The pre's
  second pass (one step, F's input only), the post (one step, the stream only) and a block's
  recompute (every step) are this one kernel reading the mappings of one kernel, so the recompute
  reproduces the forward's bits; ``_post_step`` (the post on a tile, element-wise, streams
  summed in a fixed order) is shared with ``_state_part``'s ``POST``, whatever the tile.
* ``_pre_bwd_coef`` then ``_pre_bwd_x``: two passes over ``x`` and F's input's gradient. The
  first (``BT`` tokens per program) reduces what the mappings' gradient needs and stores it per
  token (the projection's gradient, ``kappa, coef, rstd, s`` and H_res). The second runs over
  (``BC`` features, a group of tokens): it writes x's gradient (the projection's share by
  ``tl.dot``, the post's share added in place) and, from the same tiles of x, sums the mapping
  weight's gradient ``g_proj^T x`` and the norm weight's over its group: one fp32 partial per
  group, summed by torch in group order (``weight_grad_groups`` keeps them few), so no GEMM reads
  x a third time.
* ``_post_bwd``: ``BT`` tokens per program, one pass: x's and y's gradients, and the per-token
  reductions the mappings need; then Sinkhorn's backward, which keeps every iteration's input in
  registers and takes them back in reverse (2T iterations for T,
  Note [Sinkhorn's iterates kept]).
* ``_rms_fwd`` / ``_rms_bwd``: the model's final RMSNorm.

H_res's transposed layout (``HT``, a constexpr) swaps which of a pair of streams the kernels
index H_res by where they apply it or form its gradient: no transpose, no other kernel.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
import triton
import triton.language as tl
from triton import knobs
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: the ``pdl`` option stays off
    gdc_launch_dependents = gdc_wait = None

from mhc_cg.ops.kernels.hash import MAX_ELEMENTS, counter_hash, keep_scale, keep_threshold
from mhc_cg.ops.kernels.launch import launch_config
from mhc_cg.ops.kernels.tiling import (DOT_ROWS, SUM_ROWS, block_c, mapping_columns, next_pow2,
                                    post_backward_scratch, post_maps_shape, pre_backward_scratch,
                                    state_rows, state_splits, state_tiling,
                                    weight_grad_groups)
from mhc_cg.ops.kernels.reference import H_PRE_EPS, RMS_EPS, SINKHORN_EPS, state_width

INTERPRETED = bool(knobs.runtime.interpret)
_H_PRE_FLOOR = tl.constexpr(H_PRE_EPS)  # dev's h_pre = sigmoid + this

# The very function torch runs for mhc_cg.ops.dropout, jitted from its source. Triton's interpreter
# wants triton.language among the function's globals; the hash itself reads no global.
_hash = triton.jit(types.FunctionType(counter_hash.__code__, {**counter_hash.__globals__, "tl": tl},
                                      counter_hash.__name__))

CHAIN_ROWS = 4  # tokens per program elsewhere: n x n per-token sums stay in registers
# the pre backward's first pass without a post: elements per feature step over the streams
# ([CHAIN_ROWS, n, BC] tiles)
COEF_BUDGET = 256


def _indexable(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.numel() > MAX_ELEMENTS:
            raise ValueError(f"mhc_cg triton kernels index with int32: at most {MAX_ELEMENTS} elements")


def _prepared(*tensors: torch.Tensor, int32_indexed: bool = True) -> list[torch.Tensor]:
    """The tensors, contiguous (a no-op for the model's tensors), checked for int32 indexing
    unless the kernel addresses them in int64 (``int32_indexed=False``)."""
    if int32_indexed:
        _indexable(*tensors)
    for t in tensors:
        if t.dtype == torch.float64:
            raise ValueError("mhc_cg triton kernels compute in fp32: fp64 models run model.kernels: torch")
    return [t.contiguous() for t in tensors]


def _written(out: torch.Tensor | None, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Where a kernel writes: ``out`` when it is contiguous, else a new tensor (``make()``),
    which :func:`_deliver` copies into ``out``."""
    if out is None or not out.is_contiguous():
        return make()
    return out


def _deliver(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None or out is result:
        return result
    out.copy_(result)
    return out


def _dot_in_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the projection's operands go to the dot as fp32: for fp32 models, mixed dtypes,
    and in the interpreter, whose ``tl.dot`` mishandles bf16 (bf16 is exact in fp32 anyway)."""
    return INTERPRETED or x.dtype == torch.float32 or weight.dtype != x.dtype


def _precision(activations: torch.dtype) -> str:
    """The tensor-core precision of a dot with fp32 operands. Note [TF32 products]: TF32 keeps
    a 10-bit mantissa, which holds a bf16 operand exactly: in a bf16 model only the fp32 side
    (an fp32 mapping weight, the projection's fp32 gradient) is rounded, by 2^-11 relative,
    below the 2^-9 that storing the result in bf16 costs. An fp32 model gets 3xTF32 (split
    operands, three products: fp32-grade, docs/kernels.md's TF32 table). Triton's interpreter
    multiplies in fp32 whatever this says."""
    return "tf32x3" if activations == torch.float32 else "tf32"


def _pdl(config: dict) -> dict:
    """Note [programmatic dependent launch]: with a launch configuration's ``pdl`` (a sweep
    option; off by default), a kernel launches while the one before it in the stream finishes
    and waits (``gdc_wait``) before its first load, so it reads nothing early: only its launch
    and prologue overlap. The state's first stage lets the second launch when its loads are done
    (``gdc_launch_dependents``). Never under the interpreter, which has no grids to overlap."""
    on = bool(config.get("pdl")) and not INTERPRETED and gdc_wait is not None
    return {"PDL": on, "launch_pdl": on}


def _kept(iterations: int) -> int:
    """The Sinkhorn backward's slots for its iterates (Note [Sinkhorn's iterates kept])."""
    return next_pow2(max(int(iterations), 1))


def _dropout_args(seed, p):
    # The hash wraps its int32 products on purpose: keep Triton's debug-mode overflow check off.
    dropout = seed is not None and p > 0.0
    return dict(DROPOUT=dropout, THRESHOLD=keep_threshold(p) if dropout else 0,
                SCALE=keep_scale(p) if dropout else 1.0, sanitize_overflow=False)


# ---- the mappings of BT tokens, from their state ------------------------------------------------

@triton.jit
def _sigmoid(h):
    return 1.0 / (1.0 + tl.exp(-h))


@triton.jit
def _gate_logits(p, r, a_ptr, b_ptr, i, N: tl.constexpr):
    """``r * p * a + b`` for one ``[BT, NP]`` block of the projection (pre or post columns)."""
    b = tl.load(b_ptr + i, mask=i < N, other=0.0).to(tl.float32)
    return r[:, None] * p * tl.load(a_ptr).to(tl.float32) + b[None, :]


@triton.jit
def _inv_rms(state_ptr, t, tmask, sqrt_d, N: tl.constexpr, RMS: tl.constexpr):
    """``r = 1 / (|x| / sqrt(d) + eps)`` per token, from the state's xnorm column."""
    SW: tl.constexpr = N * N + 2 * N + 2
    xnorm = tl.load(state_ptr + t * SW + N * N + 2 * N, mask=tmask, other=1.0)
    return 1.0 / (xnorm / sqrt_d + RMS)


@triton.jit
def _gates(state_ptr, bias_ptr, a_ptr, r, t, tmask, FIRST: tl.constexpr, N: tl.constexpr):
    """The gates ``sigmoid(r * p * a + b)`` of one mapping (the pre's at column ``FIRST`` 0, the
    post's at ``N``), ``[BT]`` per stream, each read at its own column; the same arithmetic as
    :func:`_gate_logits`, so a gate read either way is the same bits."""
    SW: tl.constexpr = N * N + 2 * N + 2
    a = tl.load(a_ptr).to(tl.float32)
    gates = ()
    for i in tl.static_range(N):
        p = tl.load(state_ptr + t * SW + FIRST + i, mask=tmask, other=0.0)
        b = tl.load(bias_ptr + i).to(tl.float32)
        gates = gates + (_sigmoid(r * p * a + b),)
    return gates


@triton.jit
def _floored(gates, N: tl.constexpr, DEV: tl.constexpr):
    """H_pre from the pre's gates: the gates themselves (main), or dev's ``sigmoid + 1e-6``."""
    out = gates
    if DEV:
        out = ()
        for i in tl.static_range(N):
            out = out + (gates[i] + _H_PRE_FLOOR,)
    return out


@triton.jit
def _mapping_logits(state_ptr, bias_ptr, apre_ptr, apost_ptr, ares_ptr, t, tmask, sqrt_d,
                    N: tl.constexpr, NP: tl.constexpr, RMS: tl.constexpr):
    """``r [BT]``, the pre and post projections and logits ``[BT, NP]``, the res projection and
    logits ``[BT, NP, NP]`` and their mask, read from the state ``[T, m+2]``."""
    M: tl.constexpr = N * N + 2 * N
    SW: tl.constexpr = M + 2
    i = tl.arange(0, NP)
    vmask = tmask[:, None] & (i[None, :] < N)
    r = _inv_rms(state_ptr, t, tmask, sqrt_d, N, RMS)
    p_pre = tl.load(state_ptr + t[:, None] * SW + i[None, :], mask=vmask, other=0.0)
    p_post = tl.load(state_ptr + t[:, None] * SW + N + i[None, :], mask=vmask, other=0.0)
    col = 2 * N + i[:, None] * N + i[None, :]
    valid = (i[:, None] < N) & (i[None, :] < N)
    rmask = tmask[:, None, None] & valid[None, :, :]
    p_res = tl.load(state_ptr + t[:, None, None] * SW + col[None, :, :], mask=rmask, other=0.0)
    b_res = tl.load(bias_ptr + col, mask=valid, other=0.0).to(tl.float32)
    l_res = r[:, None, None] * p_res * tl.load(ares_ptr).to(tl.float32) + b_res[None, :, :]
    l_pre = _gate_logits(p_pre, r, apre_ptr, bias_ptr, i, N)
    l_post = _gate_logits(p_post, r, apost_ptr, bias_ptr + N, i, N)
    return r, p_pre, l_pre, p_post, l_post, p_res, l_res, vmask, rmask


# ---- the streams, each its own tile -------------------------------------------------------------
# Note [streams at their own offsets]: a token's n streams lie at ``t * nC + i * C``. Every kernel
# loads, computes and stores each stream as its own ``[BT, BC]`` tile (a tuple over the constexpr
# N): a post's mix is N x N per-token scalars times tiles in a fixed order; F's input and a post's
# F-output gradient sum the streams in a fixed order; per-token reductions are per-stream (or
# per-pair) ``[BT]`` accumulators, laid into ``[BT, NP]`` tiles once per program. No stream is
# picked out of a padded ``[BT, NP, BC]`` tile by a sum with one non-zero term, which cost a
# reduction across threads wherever a layout spread the streams over them. The one product over
# every stream at once, the mapping weight's gradient, takes its operand side by side
# (:func:`_side_by_side`): as N dots of M = 32 the 8 warps' MMA layout repeats each accumulator.

@triton.jit
def _load_streams(ptr, t, c, fmask, C, N: tl.constexpr):
    """The ``N`` streams of a ``[BT, BC]`` block of tokens and features, each loaded at its own
    offset ``t * nC + i * C + c``, as stored: a tuple of ``[BT, BC]`` tiles."""
    xs = ()
    for i in tl.static_range(N):
        xs = xs + (tl.load(ptr + t[:, None] * (N * C) + i * C + c[None, :], mask=fmask, other=0.0),)
    return xs


@triton.jit
def _store_streams(ptr, xs, t, c, fmask, C, N: tl.constexpr):
    """Each stream's tile stored at its own offset, in the pointer's dtype."""
    for i in tl.static_range(N):
        tl.store(ptr + t[:, None] * (N * C) + i * C + c[None, :],
                 xs[i].to(ptr.dtype.element_ty), mask=fmask)


@triton.jit
def _fp32(xs, N: tl.constexpr):
    out = ()
    for i in tl.static_range(N):
        out = out + (xs[i].to(tl.float32),)
    return out


@triton.jit
def _as_stored(xs, ptr, N: tl.constexpr):
    """The tiles in ``ptr``'s dtype, as :func:`_store_streams` stores them there."""
    out = ()
    for i in tl.static_range(N):
        out = out + (xs[i].to(ptr.dtype.element_ty),)
    return out


@triton.jit
def _rounded(xs, ptr, N: tl.constexpr):
    """The tiles as stored to ``ptr`` (rounded to its dtype), in fp32."""
    return _fp32(_as_stored(xs, ptr, N), N)


@triton.jit
def _side_by_side(xs, N: tl.constexpr, NP: tl.constexpr):
    """The streams' ``[BT, BC]`` tiles side by side, ``[BT, NP * BC]`` (stream ``i`` at columns
    ``i * BC``, zeros past ``N``): one operand for one ``tl.dot`` over every stream. Joined in
    pairs on new last axes (stream ``k + 2l + 4m`` at ``[.., k, l, m]``), then laid out."""
    BT: tl.constexpr = xs[0].shape[0]
    BC: tl.constexpr = xs[0].shape[1]
    zero = tl.zeros_like(xs[0])
    if NP == 1:
        out = xs[0]
    elif NP == 2:
        out = tl.reshape(tl.permute(tl.join(xs[0], xs[1] if N > 1 else zero), (0, 2, 1)),
                         [BT, 2 * BC])
    elif NP == 4:
        lo = tl.join(xs[0], xs[1])
        hi = tl.join(xs[2], xs[3] if N > 3 else zero)
        out = tl.reshape(tl.permute(tl.join(lo, hi), (0, 3, 2, 1)), [BT, 4 * BC])
    else:
        tl.static_assert(NP == 8, "mhc_cg: at most 8 streams")
        q0 = tl.join(tl.join(xs[0], xs[1]), tl.join(xs[2], xs[3]))
        q1 = tl.join(tl.join(xs[4], xs[5] if N > 5 else zero),
                     tl.join(xs[6] if N > 6 else zero, xs[7] if N > 7 else zero))
        out = tl.reshape(tl.permute(tl.join(q0, q1), (0, 4, 3, 2, 1)), [BT, 8 * BC])
    return out


@triton.jit
def _zeros(BT: tl.constexpr, K: tl.constexpr):
    """``K`` per-token fp32 accumulators."""
    z = ()
    for _ in tl.static_range(K):
        z = z + (tl.zeros([BT], dtype=tl.float32),)
    return z


@triton.jit
def _as_tile(vals, BT: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
    """``N`` per-token values as one ``[BT, NP]`` tile (0 on padding), once per program."""
    i = tl.arange(0, NP)
    tile = tl.zeros([BT, NP], dtype=tl.float32)
    for j in tl.static_range(N):
        tile = tl.where(i[None, :] == j, vals[j][:, None], tile)
    return tile


@triton.jit
def _as_square(vals, BT: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
    """``N * N`` per-token values (row-major) as one ``[BT, NP, NP]`` tile, once per program."""
    i = tl.arange(0, NP)
    tile = tl.zeros([BT, NP, NP], dtype=tl.float32)
    for a in tl.static_range(N):
        for b in tl.static_range(N):
            at = (i[:, None] == a) & (i[None, :] == b)
            tile = tl.where(at[None, :, :], vals[a * N + b][:, None, None], tile)
    return tile


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
def _sinkhorn(logits, mask, iterations, EPS: tl.constexpr, DEV: tl.constexpr):
    """H_res from its logits: main's Sinkhorn, or with ``DEV`` dev's."""
    if DEV:
        m = _sinkhorn_dev(logits, mask, iterations, EPS)
    else:
        m = _sinkhorn_main(logits, mask, iterations, EPS)
    return m


@triton.jit
def _sinkhorn_main(logits, mask, iterations, EPS: tl.constexpr):
    m = _sk_init(logits, mask)
    for _ in range(iterations):
        m = _sk_iteration(m, EPS)
    return m


@triton.jit
def _sk_softmax(logits, mask):
    """The rows' softmax on valid entries, 0 on padding."""
    m = _sk_init(logits, mask)
    s = tl.sum(m, axis=2)
    return m / tl.where(s > 0, s, 1.0)[:, :, None]


@triton.jit
def _sk_dev_round(m, k, EPS: tl.constexpr):
    """Round ``k`` of dev's Sinkhorn (Note [dev's Sinkhorn], ``mhc_cg/ops/kernels/reference.py``):
    the rows but in round 0, then the columns, each sum ``+ eps``; ``(row sums, after the rows,
    column sums, after the columns)``."""
    s_row = tl.sum(m, axis=2)
    mid = tl.where(k > 0, m / (s_row + EPS)[:, :, None], m)
    s_col = tl.sum(mid, axis=1)
    return s_row, mid, s_col, mid / (s_col + EPS)[:, None, :]


@triton.jit
def _sinkhorn_dev(logits, mask, iterations, EPS: tl.constexpr):
    m = tl.where(mask, _sk_softmax(logits, mask) + EPS, 0.0)
    for k in range(iterations):
        m = _sk_dev_round(m, k, EPS)[3]
    return m


@triton.jit
def _sinkhorn_dev_bwd(logits, mask, g, iterations, EPS: tl.constexpr, IP: tl.constexpr):
    """d :func:`_sinkhorn_dev` / d logits for ``g`` (0 on padding): the iterates kept as in
    Note [Sinkhorn's iterates kept]; each step ``out = m / (s + eps)`` has the derivative
    ``(g - sum(g out)) / (s + eps)``, never divided by less than eps; then the softmax's."""
    p = _sk_softmax(logits, mask)
    m = tl.where(mask, p + EPS, 0.0)
    k_ids = tl.arange(0, IP)[None, None, None, :]
    kept = m[:, :, :, None] * (k_ids * 0.0)
    for k in range(iterations):
        kept = tl.where(k_ids == k, m[:, :, :, None], kept)
        m = _sk_dev_round(m, k, EPS)[3]
    for back in range(iterations):
        k = iterations - 1 - back
        m = tl.sum(tl.where(k_ids == k, kept, 0.0), axis=3)
        s_row, mid, s_col, out = _sk_dev_round(m, k, EPS)
        g = (g - tl.sum(g * out, axis=1)[:, None, :]) / (s_col + EPS)[:, None, :]
        g = tl.where(k > 0, (g - tl.sum(g * mid, axis=2)[:, :, None]) / (s_row + EPS)[:, :, None],
                     g)
        g = tl.where(mask, g, 0.0)  # padding stays 0
    return p * (g - tl.sum(g * p, axis=2)[:, :, None])


@triton.jit
def _sk_parts(m, EPS: tl.constexpr):
    """One Sinkhorn iteration on its input ``m``, every part the backward needs: ``(row sums,
    after the rows, column sums, after the columns)``, as :func:`_sk_iteration` computes them."""
    s_row = tl.sum(m, axis=2)
    mid = m / tl.maximum(s_row, EPS)[:, :, None]
    s_col = tl.sum(mid, axis=1)
    return s_row, mid, s_col, mid / tl.maximum(s_col, EPS)[:, None, :]


@triton.jit
def _sinkhorn_bwd(logits, mask, g, iterations, EPS: tl.constexpr, IP: tl.constexpr,
                  DEV: tl.constexpr):
    """d :func:`_sinkhorn` / d logits for ``g`` (0 on padding)."""
    if DEV:
        g_l = _sinkhorn_dev_bwd(logits, mask, g, iterations, EPS, IP)
    else:
        g_l = _sinkhorn_main_bwd(logits, mask, g, iterations, EPS, IP)
    return g_l


@triton.jit
def _sinkhorn_main_bwd(logits, mask, g, iterations, EPS: tl.constexpr, IP: tl.constexpr):
    """d main's sinkhorn / d logits for ``g`` (0 on padding). ``g`` runs as the gradient with respect
    to log m (``g_m * m``), as the reference's does: m's own grows as 1/m and overflows where the
    logits spread past exp's range.

    Note [Sinkhorn's iterates kept]: one forward sweep keeps every iteration's input in
    registers (``[BT, NP, NP, IP]``, ``IP`` a power of two at least ``iterations``); the backward
    sweep takes them back in reverse, each by a sum with one non-zero term (exact), and redoes
    that one iteration for its parts: 2 x ``iterations`` iterations per token, not
    ``iterations * (iterations + 1) / 2``, and the same bits as rebuilding each from ``m0``."""
    m = _sk_init(logits, mask)
    k_ids = tl.arange(0, IP)[None, None, None, :]
    kept = m[:, :, :, None] * (k_ids * 0.0)
    for k in range(iterations):
        kept = tl.where(k_ids == k, m[:, :, :, None], kept)
        m = _sk_iteration(m, EPS)
    g = g * m  # m is the result
    for back in range(iterations):
        m = tl.sum(tl.where(k_ids == iterations - 1 - back, kept, 0.0), axis=3)
        s_row, mid, s_col, out = _sk_parts(m, EPS)
        through = tl.where(s_col >= EPS, tl.sum(g, axis=1), 0.0)
        g = g - out * through[:, None, :]
        through = tl.where(s_row >= EPS, tl.sum(g, axis=2), 0.0)
        g = tl.where(mask, g - mid * through[:, :, None], 0.0)  # padding stays 0
    g_l = g
    lmax = tl.max(tl.where(mask, logits, float("-inf")), axis=2)
    is_max = mask & (logits == lmax[:, :, None])
    ties = tl.maximum(tl.sum(is_max.to(tl.float32), axis=2), 1.0)
    g_max = -tl.sum(g_l, axis=2) / ties
    return tl.where(is_max, g_l + g_max[:, :, None], g_l)


@triton.jit
def _keep_scaled(seed_ptr, stream, index, THRESHOLD: tl.constexpr, SCALE: tl.constexpr):
    seed = tl.load(seed_ptr).to(tl.int32)
    bits = (_hash(seed, stream, index) >> 8) & 0xFFFFFF
    return tl.where(bits >= THRESHOLD, SCALE, 0.0)


@triton.jit
def _post_step(xs, y, mp, t, tmask, c, C, seed_ptr, stream, N: tl.constexpr,
               DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr, SCALE: tl.constexpr,
               HT: tl.constexpr):
    """One post on the streams ``xs`` (``N`` fp32 ``[BT, BC]`` tiles; ``y [BT, BC]``, the
    mappings at ``mp``): stream ``i`` is ``sum_j H_res[i, j] x[j]`` (``H_res[j, i]`` with
    ``HT``) accumulated in a fixed order, then ``+ dropout(H_post y)``. Every kernel that writes
    the stream runs this: element-wise steps in one order, no reduction whose order a layout
    would pick, so the forward's post and the recompute round alike."""
    MW: tl.constexpr = N + N * N
    outs = ()
    for i in tl.static_range(N):
        mix = tl.zeros_like(y)
        for j in tl.static_range(N):
            if HT:  # out[i] += h_res[j, i] x[j]
                h = tl.load(mp + t * MW + N + j * N + i, mask=tmask, other=0.0)
            else:  # out[i] += h_res[i, j] x[j]
                h = tl.load(mp + t * MW + N + i * N + j, mask=tmask, other=0.0)
            mix += h[:, None] * xs[j]
        s_post = tl.load(mp + t * MW + i, mask=tmask, other=0.0)
        branch = 2.0 * s_post[:, None] * y
        if DROPOUT:
            branch = branch * _keep_scaled(seed_ptr, stream,
                                           t[:, None] * (N * C) + i * C + c[None, :],
                                           THRESHOLD, SCALE)
        outs = outs + (mix + branch,)
    return outs


@triton.jit
def _gram_step(xs, gram, N: tl.constexpr):
    """The streams' Gram matrix ``x_i . x_j`` (``i <= j``, row-major) summed over one step's
    features into per-token accumulators."""
    out = ()
    for i in tl.static_range(N):
        for j in tl.static_range(i, N):
            acc = gram[i * N - i * (i - 1) // 2 + j - i]
            out = out + (acc + tl.sum(xs[i] * xs[j], axis=1),)
    return out


# ---- pre, first pass: the state ---------------------------------------------------------------

@triton.jit
def _state_part(x_ptr, w_ptr, part_ptr, y_ptr, maps_ptr, seed_ptr, xo_ptr, stream, T, C, span,
                N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, POST: tl.constexpr,
                DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr, SCALE: tl.constexpr,
                HT: tl.constexpr, PDL: tl.constexpr):
    """The state's sums over features ``[split * span, (split + 1) * span)`` for ``BT`` tokens
    (``program_id(1)`` is the split): the projection ``x W^T`` (one ``tl.dot`` per stream, each
    with its own rows of the weight) and the streams' Gram matrix, stored as one fp32 row
    ``[proj (MP) | gram (NP * NP)]`` per split and token for :func:`_state_sum`. With ``POST``,
    of the stream a post writes from ``x`` (its input): each tile of it is made
    (:func:`_post_step`), stored and, as stored, projected."""
    M: tl.constexpr = N * N + 2 * N
    PW: tl.constexpr = MP + NP * NP
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    first = tl.program_id(1) * span
    tmask = t < T
    mcol = tl.arange(0, MP)
    proj = tl.zeros([BT, MP], dtype=tl.float32)
    gram = _zeros(BT, N * (N + 1) // 2)
    for c0 in range(first, first + span, BC):
        c = c0 + tl.arange(0, BC)
        fmask = tmask[:, None] & (c < C)[None, :]
        xs = _load_streams(x_ptr, t, c, fmask, C, N)
        if POST:  # the tiles projected are the post's output, as stored
            y = tl.load(y_ptr + t[:, None] * C + c[None, :], mask=fmask, other=0.0).to(tl.float32)
            xs = _post_step(_fp32(xs, N), y, maps_ptr, t, tmask, c, C, seed_ptr, stream, N,
                            DROPOUT, THRESHOLD, SCALE, HT)
            xs = _as_stored(xs, xo_ptr, N)
            _store_streams(xo_ptr, xs, t, c, fmask, C, N)
        wmask = (c < C)[:, None] & (mcol < M)[None, :]
        for i in tl.static_range(N):  # stream i's rows of the weight: W[:, i * C + c]
            w = tl.load(w_ptr + mcol[None, :] * (N * C) + i * C + c[:, None], mask=wmask, other=0.0)
            if DOT_F32:
                proj = tl.dot(xs[i].to(tl.float32), w.to(tl.float32), proj, input_precision=PREC)
            else:
                proj = tl.dot(xs[i], w, proj)
        gram = _gram_step(_fp32(xs, N), gram, N)
    if PDL:  # Note [programmatic dependent launch]: the sum may start its launch
        gdc_launch_dependents()
    row = part_ptr + (tl.program_id(1) * T + t) * PW
    tl.store(row[:, None] + mcol[None, :], proj, mask=tmask[:, None])
    for i in tl.static_range(N):
        for j in tl.static_range(i, N):  # the pair's accumulator, as _gram_step orders them
            tl.store(row + MP + i * NP + j, gram[i * N - i * (i - 1) // 2 + j - i], mask=tmask)
            tl.store(row + MP + j * NP + i, gram[i * N - i * (i - 1) // 2 + j - i], mask=tmask)


@triton.jit
def _state_sum(part_ptr, bias_ptr, apre_ptr, state_ptr, T, C, splits, sqrt_d, eps,
               N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr,
               NORM: tl.constexpr, RMS: tl.constexpr, PDL: tl.constexpr, DEV: tl.constexpr):
    """The state ``[proj | xnorm | rstd]`` of ``BT`` tokens from :func:`_state_part`'s rows,
    summed over the splits in order (deterministic): the norm of x from the Gram matrix's
    trace, F's input's RMSNorm scale from the pre gates and the whole matrix."""
    if PDL:  # Note [programmatic dependent launch]
        gdc_wait()
    M: tl.constexpr = N * N + 2 * N
    SW: tl.constexpr = M + 2
    PW: tl.constexpr = MP + NP * NP
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    i = tl.arange(0, NP)
    mcol = tl.arange(0, MP)
    gcol = i[:, None] * NP + i[None, :]
    vmask = tmask[:, None] & (i < N)[None, :]
    gmask = tmask[:, None, None] & ((i[:, None] < N) & (i[None, :] < N))[None, :, :]
    proj = tl.zeros([BT, MP], dtype=tl.float32)
    p_pre = tl.zeros([BT, NP], dtype=tl.float32)
    gram = tl.zeros([BT, NP, NP], dtype=tl.float32)
    for k in range(splits):
        row = part_ptr + (k * T + t) * PW
        proj += tl.load(row[:, None] + mcol[None, :], mask=tmask[:, None], other=0.0)
        if NORM:  # the pre columns again, at their own offsets: the sums proj's first N hold
            p_pre += tl.load(row[:, None] + i[None, :], mask=vmask, other=0.0)
        gram += tl.load(row[:, None, None] + MP + gcol[None, :, :], mask=gmask, other=0.0)
    diag = (i[:, None] == i[None, :])[None, :, :]
    xnorm = tl.sqrt(tl.sum(tl.sum(tl.where(diag, gram, 0.0), axis=2), axis=1))
    smask = tmask[:, None] & (mcol[None, :] < M)
    tl.store(state_ptr + t[:, None] * SW + mcol[None, :], proj, mask=smask)
    tl.store(state_ptr + t * SW + M, xnorm, mask=tmask)
    rstd = tl.full([BT], 1.0, tl.float32)
    if NORM:
        r = 1.0 / (xnorm / sqrt_d + RMS)
        s = _sigmoid(_gate_logits(p_pre, r, apre_ptr, bias_ptr, i, N))
        if DEV:  # dev's h_pre = sigmoid + 1e-6
            s = s + _H_PRE_FLOOR
        s = tl.where((i < N)[None, :], s, 0.0)
        mean_sq = tl.sum(tl.sum(s[:, :, None] * gram * s[:, None, :], axis=2), axis=1) / C
        rstd = 1.0 / tl.sqrt(tl.maximum(mean_sq, 0.0) + eps)
    tl.store(state_ptr + t * SW + M + 1, rstd, mask=tmask)


# ---- the post's mappings, once per token ---------------------------------------------------------

@triton.jit
def _post_maps(state_ptr, bias_ptr, apost_ptr, ares_ptr, maps_ptr, T, p_stride, sqrt_d, iterations,
               N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr,
               RMS: tl.constexpr, DEV: tl.constexpr):
    """``maps [steps, T, n + n*n] = [H_post / 2 | H_res]`` of BT tokens for step
    ``program_id(1)``: Sinkhorn once per token, for every feature block of the chain to read."""
    M: tl.constexpr = N * N + 2 * N
    SW: tl.constexpr = M + 2
    MW: tl.constexpr = N + N * N
    k = tl.program_id(1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    i = tl.arange(0, NP)
    po = k * p_stride
    r, p_pre, l_pre, p_post, l_post, p_res, l_res, vmask, rmask = _mapping_logits(
        state_ptr + k * T * SW, bias_ptr + po, apost_ptr + po, apost_ptr + po, ares_ptr + po, t,
        tmask, sqrt_d, N, NP, RMS)  # the pre's logits go unused: a_post stands in for a_pre
    mp = maps_ptr + k * T * MW
    tl.store(mp + t[:, None] * MW + i[None, :], _sigmoid(l_post), mask=vmask)
    tl.store(mp + t[:, None, None] * MW + N + i[None, :, None] * N + i[None, None, :],
             _sinkhorn(l_res, rmask, iterations, EPS, DEV), mask=rmask)


# ---- the chain: F's input and the post, for one sublayer or a whole block ------------------------

@triton.jit
def _chain(x_ptr, y_ptr, state_ptr, maps_ptr, bias_ptr, apre_ptr, apost_ptr, ares_ptr, norm_ptr,
           seed_ptr, xo_ptr, fo_ptr, T, C, steps, posts, stream0, stream_step, p_stride, n_stride,
           sqrt_d, N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
           FN: tl.constexpr, POSTS: tl.constexpr, NORM: tl.constexpr, DROPOUT: tl.constexpr,
           THRESHOLD: tl.constexpr, SCALE: tl.constexpr, RMS: tl.constexpr, HT: tl.constexpr,
           PDL: tl.constexpr, DEV: tl.constexpr):
    if PDL:  # Note [programmatic dependent launch]
        gdc_wait()
    M: tl.constexpr = N * N + 2 * N
    SW: tl.constexpr = M + 2
    MW: tl.constexpr = N + N * N
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tmask = t < T
    fmask = tmask[:, None] & (c < C)[None, :]
    foff = t[:, None] * C + c[None, :]
    xs = _fp32(_load_streams(x_ptr, t, c, fmask, C, N), N)
    for k in range(steps):
        if FN:  # F's input: sum_i h_pre[i] x[i], streams in a fixed order
            st = state_ptr + k * T * SW
            po = k * p_stride
            s_pre = _floored(_gates(st, bias_ptr + po, apre_ptr + po,
                                    _inv_rms(st, t, tmask, sqrt_d, N, RMS), t, tmask, 0, N), N, DEV)
            fn = tl.zeros([BT, BC], dtype=tl.float32)
            for i in tl.static_range(N):
                fn += s_pre[i][:, None] * xs[i]
            if NORM:
                rstd = tl.load(st + t * SW + M + 1, mask=tmask, other=0.0)
                w = tl.load(norm_ptr + k * n_stride + c, mask=c < C, other=0.0).to(tl.float32)
                fn = fn * rstd[:, None] * w[None, :]
            tl.store(fo_ptr + k * T * C + foff, fn, mask=fmask)
        if POSTS and k < posts:  # POSTS False (the pre): no post code compiled in
            y = tl.load(y_ptr + k * T * C + foff, mask=fmask, other=0.0).to(tl.float32)
            xs = _post_step(xs, y, maps_ptr + k * T * MW, t, tmask, c, C, seed_ptr,
                            stream0 + k * stream_step, N, DROPOUT, THRESHOLD, SCALE, HT)
            _store_streams(xo_ptr + k * T * (N * C), xs, t, c, fmask, C, N)
            xs = _rounded(xs, xo_ptr, N)  # the next sublayer reads what the forward stored


def post_maps(states, bias, a_post, a_res, width, n, iterations, *, arithmetic="main"):
    """``[s_post | H_res]`` per post and token; the parameters may be strided views of one
    ``[P, m+3]`` block (the recompute's), so they are read in place, not made contiguous."""
    states = _prepared(states)[0]
    posts, t = states.shape[0], states.shape[1]
    maps = states.new_empty(post_maps_shape(t, n, posts), dtype=torch.float32)
    p_stride = bias.stride(0) if posts > 1 else 0
    if posts > 1 and not a_post.stride(0) == a_res.stride(0) == p_stride:
        raise ValueError("mhc_cg triton post_maps: bias, a_post and a_res must share one stride")
    if posts and t:
        config = launch_config("post_maps", width // n, states.device)
        _post_maps[(triton.cdiv(t, config["rows"]), posts)](
            states, bias, a_post, a_res, maps, t, p_stride, float(width) ** 0.5, iterations, N=n,
            NP=next_pow2(n), BT=config["rows"], EPS=SINKHORN_EPS, RMS=RMS_EPS,
            DEV=arithmetic == "dev", num_warps=config["warps"])
    return maps


def _launch_chain(x, ys, states, maps, bias, a_pre, a_post, a_res, p_stride, norm, n_stride, seed,
                  p, streams, n, x_out, fn_out, fn: bool, steps: int, posts: int,
                  h_res_transposed: bool = False, arithmetic: str = "main"):
    t, width = x.shape
    c = width // n
    nb = next_pow2(n)
    config = launch_config("chain", c, x.device)
    bc = config["features"] or block_c(c, 2048 // (nb * nb))
    stream0 = streams[0] if streams else 0
    step = streams[1] - streams[0] if len(streams) > 1 else 0
    if any(s != stream0 + k * step for k, s in enumerate(streams)):
        raise ValueError(f"mhc_cg triton recompute: a block's dropout streams must be evenly "
                         f"spaced, got {streams}")
    seed_arg = seed if seed is not None else x  # never read without dropout
    _chain[(triton.cdiv(t, config["rows"]), triton.cdiv(c, bc))](
        x, ys, states, maps if posts else x, bias, a_pre, a_post, a_res,
        norm if norm is not None else x, seed_arg, x_out, fn_out, t, c, steps, posts, stream0,
        step, p_stride, n_stride, float(width) ** 0.5, N=n, BT=config["rows"], BC=bc, FN=fn,
        POSTS=posts > 0, NORM=norm is not None, RMS=RMS_EPS, HT=h_res_transposed,
        DEV=arithmetic == "dev", **_dropout_args(seed, p), **_pdl(config),
        num_warps=config["warps"])


def _launch_state(x, weight, bias, a_pre, norm: bool, eps, n, state_out, post=None,
                  arithmetic: str = "main"):
    """The state of ``x``, or with ``post = (maps, y, seed, p, stream, out, h_res_transposed)``
    of the post's output, which it writes into ``out``: sums over feature splits enough to fill
    the GPU (:func:`_state_part`), then summed in order (:func:`_state_sum`). One pair of kernels
    and one tiling either way, so a state is the same bits whichever op made it."""
    t, width = x.shape
    c = width // n
    config = launch_config("state", c, x.device)
    rows = state_rows(x.element_size(), weight.element_size(), config["rows"])
    nb, mp, bc = state_tiling(c, n, rows)
    state = _written(state_out, lambda: x.new_empty(t, state_width(weight.shape[0]),
                                                   dtype=torch.float32))
    maps, y, seed, p, stream, out, transposed = post or (x, x, None, 0.0, 0, x, False)
    splits, span = state_splits(t, c, bc, rows, config["splits"])
    pdl = _pdl(config)
    part = x.new_empty(splits, t, mp + nb * nb, dtype=torch.float32)
    # x's tl.dot tiles run num_stages - 1 steps ahead
    _state_part[(triton.cdiv(t, rows), splits)](
        x, weight, part, y, maps, seed if seed is not None else x, out, stream, t, c, span, N=n,
        NP=nb, MP=mp, BT=rows, BC=bc, DOT_F32=_dot_in_fp32(x, weight), PREC=_precision(x.dtype),
        POST=post is not None, HT=transposed, **_dropout_args(seed, p),
        PDL=pdl["PDL"], num_warps=config["warps"], num_stages=config["stages"])
    _state_sum[(triton.cdiv(t, SUM_ROWS),)](
        part, bias, a_pre, state, t, c, splits, float(width) ** 0.5, float(eps), N=n, NP=nb,
        MP=mp, BT=SUM_ROWS, NORM=norm, RMS=RMS_EPS, DEV=arithmetic == "dev", **pdl)
    return _deliver(state, state_out)


def fn_input(x, state, a_pre, a_post, a_res, bias, norm_weight, n, fn_input_out=None, *,
             arithmetic="main"):
    """The pre's second pass alone: F's input from ``x`` and its state."""
    x, state = _prepared(x, state)
    fn = _written(fn_input_out, lambda: x.new_empty(x.shape[0], x.shape[1] // n))
    _launch_chain(x, x, state, None, bias, a_pre, a_post, a_res, 0, norm_weight, 0, None, 0.0, [0],
                  n, x, fn, fn=True, steps=1, posts=0, arithmetic=arithmetic)
    return _deliver(fn, fn_input_out)


def pre(x, weight, a_pre, a_post, a_res, bias, norm_weight, n, iterations, eps,
        fn_input_out=None, state_out=None, *, arithmetic="main"):
    x, weight = _prepared(x, weight)
    state = _launch_state(x, weight, bias, a_pre, norm_weight is not None, eps, n, state_out,
                          arithmetic=arithmetic)
    return fn_input(x, state, a_pre, a_post, a_res, bias, norm_weight, n, fn_input_out,
                    arithmetic=arithmetic), state


def post_state(x, maps, y, seed, p, stream, n, weight, a_pre, bias, norm, eps, out=None,
               state_out=None, *, h_res_transposed=False, arithmetic="main"):
    """``(post's output, the next pre's state)``: the post (mappings ``maps``) and the state of
    what it writes, for the next pre (``weight``, ``a_pre``, ``bias``, ``norm``, ``eps``), in
    one pass: the next pre reads its input once."""
    x, maps, y, weight = _prepared(x, maps, y, weight)
    result = _written(out, lambda: torch.empty_like(x))
    state = _launch_state(x, weight, bias, a_pre, norm, eps, n, state_out,
                          (maps, y, seed, p, stream, result, h_res_transposed), arithmetic)
    return _deliver(result, out), state


def post(x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations, out=None, *,
         h_res_transposed=False, maps=None, arithmetic="main"):
    x, state, y = _prepared(x, state, y)
    if maps is None:
        maps = post_maps(state[None], bias[None], a_post, a_res, x.shape[1], n, iterations,
                         arithmetic=arithmetic)
    maps = _prepared(maps)[0]
    result = _written(out, lambda: torch.empty_like(x))
    _launch_chain(x, y, state, maps, bias, a_pre, a_post, a_res, 0, None, 0, seed, p, [stream], n,
                  result, x, fn=False, steps=1, posts=1, h_res_transposed=h_res_transposed)
    return _deliver(result, out)


def recompute(x0, ys, states, params, norm_weights, seed, p, streams, n, iterations, eps, x_out,
              fn_input_out, *, h_res_transposed=False, maps=None, arithmetic="main"):
    x0, ys, states, params = _prepared(x0, ys, states, params)
    m = n * n + 2 * n
    if maps is None:
        maps = post_maps(states[:-1], params[:-1, :m], params[:-1, m + 1], params[:-1, m + 2],
                         x0.shape[1], n, iterations, arithmetic=arithmetic)
    maps = _prepared(maps)[0]
    norm = None if norm_weights is None else _prepared(norm_weights)[0]
    _indexable(x_out, fn_input_out)  # (S-1) x T x nC outgrows the inputs, and wraps in int32
    steps = ys.shape[0]
    xo = _written(x_out, lambda: torch.empty_like(x_out))
    fo = _written(fn_input_out, lambda: torch.empty_like(fn_input_out))
    _launch_chain(x0, ys, states, maps, params, params[:, m], params[:, m + 1], params[:, m + 2],
                  params.stride(0), norm, 0 if norm is None else norm.stride(0), seed, p,
                  list(streams), n, xo if steps > 1 else x0, fo, fn=True,
                  steps=steps, posts=steps - 1, h_res_transposed=h_res_transposed,
                  arithmetic=arithmetic)
    _deliver(xo, x_out)
    _deliver(fo, fn_input_out)


# ---- pre backward ------------------------------------------------------------------------------

@triton.jit
def _pre_state_grads(gstate_ptr, gproj_ptr, share_ptr, apre_ptr, gh, r, p_pre, xnorm, t, tmask,
                     vmask, sqrt_d, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
                     PP: tl.constexpr, ADD_SHARES: tl.constexpr):
    """The state's gradient, the pre's own (from the pre logits' ``gh`` and xnorm) plus what the
    post sent; stores the projection's gradient and the parameters' shares (``ADD_SHARES``: onto
    the post's, stored there by this program; their columns are disjoint); returns the
    projection's gradient ``[BT, MP]`` and x's coefficient from xnorm's gradient."""
    M: tl.constexpr = N * N + 2 * N
    SW: tl.constexpr = M + 2
    P: tl.constexpr = M + 3
    i = tl.arange(0, NP)
    mcol = tl.arange(0, MP)
    a_pre = tl.load(apre_ptr).to(tl.float32)
    smask = tmask[:, None] & (mcol[None, :] < M)
    g_proj = tl.load(gstate_ptr + t[:, None] * SW + mcol[None, :], mask=smask, other=0.0)
    own = tl.where(vmask, gh * a_pre * r[:, None], 0.0)
    pick = (mcol[None, None, :] == i[None, :, None]) & (i < N)[None, :, None]
    g_proj += tl.sum(tl.where(pick, own[:, :, None], 0.0), axis=1)
    tl.store(gproj_ptr + t[:, None] * M + mcol[None, :], g_proj, mask=smask)
    g_xnorm = tl.load(gstate_ptr + t * SW + M, mask=tmask, other=0.0) \
        + tl.sum(gh * a_pre * p_pre, axis=1) * (-r * r / sqrt_d)
    coef = tl.where(xnorm > 0, g_xnorm / tl.where(xnorm > 0, xnorm, 1.0), 0.0)
    pcol = tl.arange(0, PP)  # the pre gives the post's and res's bias and alphas nothing
    a_share = tl.sum(gh * r[:, None] * p_pre, axis=1)
    to_col = (pcol[None, None, :] == i[None, :, None]) & (i < N)[None, :, None]
    shares = tl.sum(tl.where(to_col, gh[:, :, None], 0.0), axis=1)
    shares = tl.where(pcol[None, :] == M, a_share[:, None], shares)
    pmask = tmask[:, None] & (pcol[None, :] < P)
    if ADD_SHARES:
        shares += tl.load(share_ptr + t[:, None] * P + pcol[None, :], mask=pmask, other=0.0)
    tl.store(share_ptr + t[:, None] * P + pcol[None, :], shares, mask=pmask)
    return g_proj, coef


@triton.jit
def _pre_bwd_coef(gout_ptr, gin_ptr, gstate_ptr, x_ptr, bias_ptr, apre_ptr, apost_ptr, ares_ptr,
                  norm_ptr, state_ptr, gproj_ptr, share_ptr, aux_ptr, gpost_ptr, y_ptr, seed_ptr,
                  pstate_ptr, pbias_ptr, papost_ptr, stream, T, C, sqrt_d, iterations,
                  N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, PP: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr, NORM: tl.constexpr, GPOST: tl.constexpr,
                  EPS: tl.constexpr, RMS: tl.constexpr, POST: tl.constexpr, PREV: tl.constexpr,
                  GIN: tl.constexpr, DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr,
                  SCALE: tl.constexpr, HT: tl.constexpr, AW: tl.constexpr, IP: tl.constexpr,
                  DEV: tl.constexpr):
    """The first pass: what x's gradient needs per token, from one read of x and g_out: the
    projection's gradient, the parameters' shares and ``aux = [kappa, coef, rstd, s | H_res |
    s_prev]``. ``POST``: the sublayer's post's reductions too, from the same read of x and one
    of g_post, added to the state's gradient ``gin`` (``GIN``: given; none reached the state
    but through the post otherwise) into ``gstate`` before the pre reads it there (without
    ``POST``, ``gstate`` is ``gin``). ``PREV``: ``s_prev``, the H_post / 2 of the post
    that wrote x, for the second pass."""
    M: tl.constexpr = N * N + 2 * N
    SW: tl.constexpr = M + 2
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    i = tl.arange(0, NP)
    r, p_pre, l_pre, p_post, l_post, p_res, l_res, vmask, rmask = _mapping_logits(
        state_ptr, bias_ptr, apre_ptr, apost_ptr, ares_ptr, t, tmask, sqrt_d, N, NP, RMS)
    g_i = _gates(state_ptr, bias_ptr, apre_ptr, r, t, tmask, 0, N)  # the sigmoids
    s_i = _floored(g_i, N, DEV)  # H_pre
    s = _as_tile(s_i, BT, N, NP)
    sig = _as_tile(g_i, BT, N, NP)
    xnorm = tl.load(state_ptr + t * SW + M, mask=tmask, other=0.0)
    rstd = tl.load(state_ptr + t * SW + M + 1, mask=tmask, other=0.0)
    # u[i] = x[i] . (g w) and v[i] = x[i] . agg, what the mappings' gradient needs
    u = _zeros(BT, N)
    v = _zeros(BT, N)
    g_hres = _zeros(BT, N * N)
    g_spost = _zeros(BT, N)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        fmask = tmask[:, None] & (c < C)[None, :]
        xs = _fp32(_load_streams(x_ptr, t, c, fmask, C, N), N)
        g = tl.load(gout_ptr + t[:, None] * C + c[None, :], mask=fmask, other=0.0).to(tl.float32)
        if NORM:
            g = g * tl.load(norm_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
            agg = tl.zeros([BT, BC], dtype=tl.float32)
            for j in tl.static_range(N):
                agg += s_i[j][:, None] * xs[j]
            v = _dots(xs, agg, v, N)
        u = _dots(xs, g, u, N)
        if POST:
            gps = _fp32(_load_streams(gpost_ptr, t, c, fmask, C, N), N)
            y = tl.load(y_ptr + t[:, None] * C + c[None, :], mask=fmask, other=0.0).to(tl.float32)
            gms = _masked(gps, seed_ptr, stream, t, c, C, N, DROPOUT, THRESHOLD, SCALE)
            g_hres, g_spost = _post_sums(gps, gms, xs, y, g_hres, g_spost, N, HT)
    u = _as_tile(u, BT, N, NP)
    v = _as_tile(v, BT, N, NP)
    if POST:  # the post's share first, into the state's gradient the pre's part reads
        s_post = _as_tile(_gates(state_ptr, bias_ptr + N, apost_ptr, r, t, tmask, N, N), BT, N, NP)
        _post_state_grads(gin_ptr, gstate_ptr, share_ptr, _as_square(g_hres, BT, N, NP),
                          _as_tile(g_spost, BT, N, NP), s_post, r, p_post, l_res, p_res,
                          apost_ptr, ares_ptr, t, tmask, vmask, rmask, sqrt_d, iterations, N, NP,
                          BT, EPS, GIN, IP, DEV)
        tl.debug_barrier()
    if NORM:
        g_rstd = tl.load(gstate_ptr + t * SW + M + 1, mask=tmask, other=0.0)
        kappa = rstd * rstd * rstd * (tl.sum(s * u, axis=1) + g_rstd) / C
        g_s = rstd[:, None] * u - kappa[:, None] * v
    else:
        kappa = tl.zeros([BT], dtype=tl.float32)
        g_s = u
    gh = g_s * sig * (1.0 - sig)
    g_proj, coef = _pre_state_grads(gstate_ptr, gproj_ptr, share_ptr, apre_ptr, gh, r, p_pre, xnorm,
                                    t, tmask, vmask, sqrt_d, N, NP, MP, PP, POST)
    tl.store(aux_ptr + t * AW, kappa, mask=tmask)
    tl.store(aux_ptr + t * AW + 1, coef, mask=tmask)
    tl.store(aux_ptr + t * AW + 2, rstd, mask=tmask)
    tl.store(aux_ptr + t[:, None] * AW + 3 + i[None, :], s, mask=vmask)
    if GPOST:
        h_res = _sinkhorn(l_res, rmask, iterations, EPS, DEV)
        tl.store(aux_ptr + t[:, None, None] * AW + 3 + N + i[None, :, None] * N + i[None, None, :],
                 h_res, mask=rmask)
    if PREV:
        _store_prev_gates(aux_ptr, pstate_ptr, pbias_ptr, papost_ptr, t, tmask, sqrt_d, N, RMS, AW)


@triton.jit
def _store_prev_gates(aux_ptr, pstate_ptr, pbias_ptr, papost_ptr, t, tmask, sqrt_d,
                      N: tl.constexpr, RMS: tl.constexpr, AW: tl.constexpr):
    """The previous post's H_post / 2 into ``aux``, as its own backward computes it."""
    s_prev = _gates(pstate_ptr, pbias_ptr + N, papost_ptr,
                    _inv_rms(pstate_ptr, t, tmask, sqrt_d, N, RMS), t, tmask, N, N)
    for j in tl.static_range(N):
        tl.store(aux_ptr + t * AW + 3 + N + N * N + j, s_prev[j], mask=tmask)


@triton.jit
def _x_tiles(x_ptr, gout_ptr, gpost_ptr, t0, end, C, c, N: tl.constexpr, BT: tl.constexpr,
             GPOST: tl.constexpr):
    """The second pass's streamed tiles of the step at ``t0`` as stored (x's and g_post's
    streams, g_out), none past ``end``: in place, the rows past its group are another program's
    to overwrite."""
    t = t0 + tl.arange(0, BT)
    fmask = (t < end)[:, None] & (c < C)[None, :]
    xs = _load_streams(x_ptr, t, c, fmask, C, N)
    g = tl.load(gout_ptr + t[:, None] * C + c[None, :], mask=fmask, other=0.0)
    gps = _load_streams(gpost_ptr, t, c, fmask, C, N) if GPOST else xs
    return xs, g, gps


@triton.jit
def _stream_grads(xs, gps, s, g_agg, coef, g_proj, w_blk, aux_ptr, t, tmask, N: tl.constexpr,
                  HT: tl.constexpr, AW: tl.constexpr, GPOST: tl.constexpr, PREC: tl.constexpr):
    """x's gradient, stream by stream: through the pre's aggregate, the projection (one
    ``tl.dot`` with the stream's rows of the weight, Note [TF32 products]) and xnorm, then with
    ``GPOST`` the post's residual path ``H_res^T g_post`` (``H_res g_post`` transposed)."""
    gxs = ()
    for i in tl.static_range(N):
        through_proj = tl.dot(g_proj, w_blk[i], input_precision=PREC)
        gx = s[i][:, None] * g_agg + through_proj + coef[:, None] * xs[i]
        if GPOST:
            for j in tl.static_range(N):
                if HT:  # gx[i] += h_res[i, j] g_post[j]
                    h = tl.load(aux_ptr + t * AW + 3 + N + i * N + j, mask=tmask, other=0.0)
                else:  # gx[i] += h_res[j, i] g_post[j]
                    h = tl.load(aux_ptr + t * AW + 3 + N + j * N + i, mask=tmask, other=0.0)
                gx += h[:, None] * gps[j]
        gxs = gxs + (gx,)
    return gxs


@triton.jit
def _pre_bwd_x(gout_ptr, gpost_ptr, x_ptr, w_ptr, norm_ptr, gproj_ptr, aux_ptr, gx_ptr, gwt_ptr,
               gw_ptr, gy_ptr, seed_ptr, pstream, T, C, per_group, N: tl.constexpr,
               NP: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               NORM: tl.constexpr, GPOST: tl.constexpr, IN_PLACE: tl.constexpr, HT: tl.constexpr,
               PREV: tl.constexpr, DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr,
               SCALE: tl.constexpr, AW: tl.constexpr, PREC: tl.constexpr):
    """The second pass, over (a feature chunk, a group of tokens): x's gradient, and the mapping
    weight's and the norm weight's gradients summed over the group (fixed order) from the same
    reads of x: no GEMM reads x again for the weight. Stream by stream
    (Note [streams at their own offsets]): each stream's weight rows, products and gradient
    tiles are its own.
    ``PREV``: also the gradient of the F output of the post that wrote x, from x's gradient as
    stored (:func:`_grad_y`, the post's formula). The streamed tiles are loaded two steps ahead
    into registers: at the registers this pass needs one block fits on an SM, and two steps in
    flight keep as many bytes outstanding as two blocks would (``mhc-cg kernels``)."""
    M: tl.constexpr = N * N + 2 * N
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    group = tl.program_id(1)
    mcol = tl.arange(0, MP)
    wmask = (mcol < M)[:, None] & (c < C)[None, :]
    w_blk = ()  # stream i's rows of the weight, W[:, i * C + c]
    g_weight = tl.zeros([MP, NP * BC], dtype=tl.float32)
    for i in tl.static_range(N):
        w = tl.load(w_ptr + mcol[:, None] * (N * C) + i * C + c[None, :], mask=wmask, other=0.0)
        w_blk = w_blk + (w.to(tl.float32),)
    wn = tl.load(norm_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    g_norm = tl.zeros([BC], dtype=tl.float32)
    start = group * per_group
    end = tl.minimum(start + per_group, T)
    # loads of step k + 2 are issued before step k's arithmetic waits on its own
    ahead1 = _x_tiles(x_ptr, gout_ptr, gpost_ptr, start, end, C, c, N, BT, GPOST)
    ahead2 = _x_tiles(x_ptr, gout_ptr, gpost_ptr, start + BT, end, C, c, N, BT, GPOST)
    for t0 in range(start, start + per_group, BT):
        x_raw, g_raw, gp_raw = ahead1
        ahead1 = ahead2
        ahead2 = _x_tiles(x_ptr, gout_ptr, gpost_ptr, t0 + 2 * BT, end, C, c, N, BT, GPOST)
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        fmask = tmask[:, None] & (c < C)[None, :]
        kappa = tl.load(aux_ptr + t * AW, mask=tmask, other=0.0)
        coef = tl.load(aux_ptr + t * AW + 1, mask=tmask, other=0.0)
        rstd = tl.load(aux_ptr + t * AW + 2, mask=tmask, other=0.0)
        g_proj = tl.load(gproj_ptr + t[:, None] * M + mcol[None, :],
                         mask=tmask[:, None] & (mcol < M)[None, :], other=0.0)
        xs = _fp32(x_raw, N)
        g = g_raw.to(tl.float32)
        s = ()
        for i in tl.static_range(N):
            s = s + (tl.load(aux_ptr + t * AW + 3 + i, mask=tmask, other=0.0),)
        if NORM:
            agg = tl.zeros([BT, BC], dtype=tl.float32)
            for i in tl.static_range(N):
                agg += s[i][:, None] * xs[i]
            g_agg = rstd[:, None] * (g * wn[None, :]) - kappa[:, None] * agg
            g_norm += tl.sum(g * agg * rstd[:, None], axis=0)
        else:
            g_agg = g
        gxs = _stream_grads(xs, _fp32(gp_raw, N), s, g_agg, coef, g_proj, w_blk, aux_ptr, t,
                            tmask, N, HT, AW, GPOST, PREC)
        if IN_PLACE:  # every thread has read its part of g_post before any overwrites it
            tl.debug_barrier()
        _store_streams(gx_ptr, gxs, t, c, fmask, C, N)
        if PREV:  # from g_x as the post's backward would read it: rounded to its dtype
            s_prev = ()
            for j in tl.static_range(N):
                s_prev = s_prev + (tl.load(aux_ptr + t * AW + 3 + N + N * N + j, mask=tmask,
                                           other=0.0),)
            gms = _masked(_rounded(gxs, gx_ptr, N), seed_ptr, pstream, t, c, C, N, DROPOUT,
                          THRESHOLD, SCALE)
            tl.store(gy_ptr + t[:, None] * C + c[None, :], _grad_y(gms, s_prev, N), mask=fmask)
        # the weight's gradient g_proj^T x, fp32 operands on tensor cores (Note [TF32 products])
        g_weight = tl.dot(tl.trans(g_proj), _side_by_side(xs, N, NP), g_weight,
                          input_precision=PREC)
    i = tl.arange(0, NP)
    gmask = (mcol < M)[:, None, None] & (i < N)[None, :, None] & (c < C)[None, None, :]
    tl.store(gwt_ptr + group * (M * N * C) + mcol[:, None, None] * (N * C) + i[None, :, None] * C
             + c[None, None, :], tl.reshape(g_weight, [MP, NP, BC]), mask=gmask)
    if NORM:
        tl.store(gw_ptr + group * C + c, g_norm, mask=c < C)


def pre_backward(g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight,
                 state, n, iterations, eps, g_x_out=None, *, h_res_transposed=False, post=None,
                 prev=None, g_y_out=None, arithmetic="main"):
    if g_state is None and post is None:  # nothing reached the state: its gradient is zero
        g_state = state.new_zeros(state.shape, dtype=torch.float32)
    g_out, x, weight, state = _prepared(g_out, x, weight, state)
    g_in = None if g_state is None else _prepared(g_state)[0].to(torch.float32)
    t, width = x.shape
    c = width // n
    m = weight.shape[0]
    nb = next_pow2(n)
    in_place = g_x_out is not None and g_x_out is g_post and g_post.is_contiguous()
    if g_post is not None and not in_place:
        g_post = _prepared(g_post)[0]
    g_x = g_post if in_place else _written(g_x_out, lambda: torch.empty_like(x))
    scratch = {name: x.new_empty(shape, dtype=torch.float32)
               for name, shape in pre_backward_scratch(t, c, n, m, post is not None,
                                                       prev is not None).items()}
    g_proj, shares, aux, g_weight = (scratch[k] for k in ("g_proj", "shares", "aux", "g_weight"))
    g_sum = scratch.get("g_state", g_in)  # with the post's reductions: the state's gradient
    norm = norm_weight if norm_weight is not None else x
    y, seed, p, stream = post if post is not None else (x, None, 0.0, 0)
    p_state, p_a_post, p_bias, p_seed, p_p, p_stream = prev if prev is not None else \
        (state, a_post, bias, None, 0.0, 0)
    if post is not None and prev is not None and (seed is not p_seed or p != p_p):
        raise ValueError("mhc_cg pre_backward: the posts around a pre share one seed and rate")
    seed, p = (seed, p) if post is not None else (p_seed, p_p)
    # with the post's reductions, its tiles and layout: the same sums as its own backward's;
    # without, the same tokens per program (a grid of T / 4 fills the GPU)
    bt = CHAIN_ROWS
    bc1 = block_c(c, 1024 // (nb * nb) if post is not None else COEF_BUDGET // nb)
    _pre_bwd_coef[(triton.cdiv(t, bt),)](
        g_out, g_in if g_in is not None else g_sum, g_sum, x, bias, a_pre, a_post, a_res, norm,
        state, g_proj, shares, aux, g_post if g_post is not None else x, y,
        seed if seed is not None else x, p_state, p_bias, p_a_post, stream, t, c,
        float(width) ** 0.5, iterations, N=n, NP=nb, MP=mapping_columns(n), PP=triton.next_power_of_2(m + 3),
        BT=bt, BC=bc1, NORM=norm_weight is not None, GPOST=g_post is not None, EPS=SINKHORN_EPS,
        RMS=RMS_EPS, POST=post is not None, PREV=prev is not None, GIN=g_in is not None,
        HT=h_res_transposed, AW=aux.shape[1], IP=_kept(iterations), DEV=arithmetic == "dev",
        **_dropout_args(seed, p), num_warps=4)
    groups, per_group = weight_grad_groups(t, c, m, n)
    g_w = x.new_empty(groups if norm_weight is not None else 0, c, dtype=torch.float32)
    g_y = None if prev is None else _written(g_y_out, lambda: x.new_empty(t, c))
    _pre_bwd_x[(triton.cdiv(c, block_c(c, 128 // nb)), groups)](
        g_out, g_post if g_post is not None else x, x, weight, norm, g_proj, aux, g_x, g_weight,
        g_w, g_y if g_y is not None else x, seed if seed is not None else x, p_stream, t, c,
        per_group, N=n, NP=nb, MP=mapping_columns(n), BT=DOT_ROWS, BC=block_c(c, 128 // nb),
        NORM=norm_weight is not None, GPOST=g_post is not None, IN_PLACE=in_place,
        HT=h_res_transposed, PREV=prev is not None, AW=aux.shape[1], PREC=_precision(x.dtype),
        **_dropout_args(seed, p), num_warps=8, num_stages=1)  # Triton's pipelining took 255 registers; it prefetches itself
    if g_y is not None:
        _deliver(g_y, g_y_out)
    return _deliver(g_x, g_x_out), g_weight.sum(0).to(weight.dtype), shares, g_w


# ---- post backward -----------------------------------------------------------------------------

@triton.jit
def _masked(gs, seed_ptr, stream, t, c, C, N: tl.constexpr, DROPOUT: tl.constexpr,
            THRESHOLD: tl.constexpr, SCALE: tl.constexpr):
    """A post output's gradient streams through the post's dropout mask."""
    if DROPOUT:
        out = ()
        for i in tl.static_range(N):
            keep = _keep_scaled(seed_ptr, stream, t[:, None] * (N * C) + i * C + c[None, :],
                                THRESHOLD, SCALE)
            out = out + (gs[i] * keep,)
        gs = out
    return gs


@triton.jit
def _grad_y(gms, s_post, N: tl.constexpr):
    """F's output's gradient through a post, ``sum_j 2 s_post[j] gm[j]`` from its output's
    masked gradient streams: in a fixed order, so that every kernel that computes it (the
    post's backward, the next pre's second pass) rounds alike."""
    acc = tl.zeros_like(gms[0])
    for j in tl.static_range(N):
        acc += 2.0 * s_post[j][:, None] * gms[j]
    return acc


@triton.jit
def _dots(xs, g, acc, N: tl.constexpr):
    """``acc[i] + x[i] . g`` over one step's features, per stream."""
    out = ()
    for i in tl.static_range(N):
        out = out + (acc[i] + tl.sum(xs[i] * g, axis=1),)
    return out


@triton.jit
def _post_sums(gs, gms, xs, y, g_hres, g_spost, N: tl.constexpr, HT: tl.constexpr):
    """One feature step of a post's per-token reductions, stream by stream: ``g . x`` through
    H_res (``N * N`` accumulators, row-major) and ``gm . y`` (gm: g masked) through H_post."""
    hres = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            if HT:  # d out[j] / d h_res[i, j] = x[i]
                hres = hres + (g_hres[i * N + j] + tl.sum(xs[i] * gs[j], axis=1),)
            else:  # d out[i] / d h_res[i, j] = x[j]
                hres = hres + (g_hres[i * N + j] + tl.sum(gs[i] * xs[j], axis=1),)
    return hres, _dots(gms, y, g_spost, N)


@triton.jit
def _post_state_grads(gin_ptr, gstate_ptr, share_ptr, g_hres, g_spost, s_post, r, p_post, l_res,
                      p_res, apost_ptr, ares_ptr, t, tmask, vmask, rmask, sqrt_d, iterations,
                      N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr,
                      ADD: tl.constexpr, IP: tl.constexpr, DEV: tl.constexpr):
    """A post's state gradient ``[0 | post | res | xnorm | 0]`` and parameter shares from its
    reductions, stored by columns; ``ADD``: added to the state gradient ``gin`` (the pre's
    backward's input), every column of the sum stored."""
    M: tl.constexpr = N * N + 2 * N
    SW: tl.constexpr = M + 2
    P: tl.constexpr = M + 3
    i = tl.arange(0, NP)
    gh_post = g_spost * 2.0 * s_post * (1.0 - s_post)
    gh_res = _sinkhorn_bwd(l_res, rmask, g_hres, iterations, EPS, IP, DEV)
    a_post = tl.load(apost_ptr).to(tl.float32)
    a_res = tl.load(ares_ptr).to(tl.float32)
    col = 2 * N + i[:, None] * N + i[None, :]
    zero = tl.zeros([BT, NP], dtype=tl.float32)
    v_post = gh_post * a_post * r[:, None]
    v_res = gh_res * a_res * r[:, None, None]
    g_r = tl.sum(gh_post * a_post * p_post, axis=1) \
        + tl.sum(tl.sum(gh_res * a_res * p_res, axis=2), axis=1)
    v_xnorm = g_r * (-r * r / sqrt_d)
    v_pre = zero
    v_rstd = tl.zeros([BT], dtype=tl.float32)
    if ADD:
        v_pre = tl.load(gin_ptr + t[:, None] * SW + i[None, :], mask=vmask, other=0.0)
        v_post += tl.load(gin_ptr + t[:, None] * SW + N + i[None, :], mask=vmask, other=0.0)
        v_res += tl.load(gin_ptr + t[:, None, None] * SW + col[None, :, :], mask=rmask, other=0.0)
        v_xnorm += tl.load(gin_ptr + t * SW + M, mask=tmask, other=0.0)
        v_rstd = tl.load(gin_ptr + t * SW + M + 1, mask=tmask, other=0.0)
    tl.store(gstate_ptr + t[:, None] * SW + i[None, :], v_pre, mask=vmask)
    tl.store(gstate_ptr + t * SW + M + 1, v_rstd, mask=tmask)
    tl.store(gstate_ptr + t[:, None] * SW + N + i[None, :], v_post, mask=vmask)
    tl.store(gstate_ptr + t[:, None, None] * SW + col[None, :, :], v_res, mask=rmask)
    tl.store(gstate_ptr + t * SW + M, v_xnorm, mask=tmask)
    tl.store(share_ptr + t[:, None] * P + i[None, :], zero, mask=vmask)
    tl.store(share_ptr + t[:, None] * P + N + i[None, :], gh_post, mask=vmask)
    tl.store(share_ptr + t[:, None, None] * P + col[None, :, :], gh_res, mask=rmask)
    tl.store(share_ptr + t * P + M, tl.zeros([BT], dtype=tl.float32), mask=tmask)
    tl.store(share_ptr + t * P + M + 1, tl.sum(gh_post * r[:, None] * p_post, axis=1), mask=tmask)
    tl.store(share_ptr + t * P + M + 2,
             tl.sum(tl.sum(gh_res * r[:, None, None] * p_res, axis=2), axis=1), mask=tmask)


@triton.jit
def _post_bwd(g_ptr, x_ptr, state_ptr, bias_ptr, apre_ptr, apost_ptr, ares_ptr, y_ptr, seed_ptr,
              gstate_ptr, share_ptr, gy_ptr, stream, T, C, sqrt_d, iterations,
              N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
              DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr, SCALE: tl.constexpr,
              EPS: tl.constexpr, RMS: tl.constexpr, HT: tl.constexpr, REDUCE: tl.constexpr,
              IP: tl.constexpr, DEV: tl.constexpr):
    """The post's backward from its output's gradient g: F's output's gradient, and with
    ``REDUCE`` its reductions (the state's gradient and the shares); without, g_y alone."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    i = tl.arange(0, NP)
    r, p_pre, l_pre, p_post, l_post, p_res, l_res, vmask, rmask = _mapping_logits(
        state_ptr, bias_ptr, apre_ptr, apost_ptr, ares_ptr, t, tmask, sqrt_d, N, NP, RMS)
    s_post = _gates(state_ptr, bias_ptr + N, apost_ptr, r, t, tmask, N, N)
    g_hres = _zeros(BT, N * N)
    g_spost = _zeros(BT, N)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        fmask = tmask[:, None] & (c < C)[None, :]
        gs = _fp32(_load_streams(g_ptr, t, c, fmask, C, N), N)
        gms = _masked(gs, seed_ptr, stream, t, c, C, N, DROPOUT, THRESHOLD, SCALE)
        tl.store(gy_ptr + t[:, None] * C + c[None, :], _grad_y(gms, s_post, N), mask=fmask)
        if REDUCE:
            xs = _fp32(_load_streams(x_ptr, t, c, fmask, C, N), N)
            y = tl.load(y_ptr + t[:, None] * C + c[None, :], mask=fmask, other=0.0).to(tl.float32)
            g_hres, g_spost = _post_sums(gs, gms, xs, y, g_hres, g_spost, N, HT)
    if REDUCE:
        _post_state_grads(gstate_ptr, gstate_ptr, share_ptr, _as_square(g_hres, BT, N, NP),
                          _as_tile(g_spost, BT, N, NP), _as_tile(s_post, BT, N, NP), r, p_post,
                          l_res, p_res, apost_ptr, ares_ptr, t, tmask, vmask, rmask, sqrt_d,
                          iterations, N, NP, BT, EPS, False, IP, DEV)


def post_backward(g, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations, *,
                  h_res_transposed=False, arithmetic="main"):
    g, x, state, y = _prepared(g, x, state, y)
    t, width = x.shape
    m = n * n + 2 * n
    g_y = torch.empty_like(y)
    g_state = x.new_empty(t, m + 2, dtype=torch.float32)
    shares = x.new_empty(post_backward_scratch(t, width // n, n, m)["shares"], dtype=torch.float32)
    _launch_post_bwd(g, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations,
                     g_state, shares, g_y, h_res_transposed, reduce=True,
                     dev=arithmetic == "dev")
    return g_state, shares, g_y


def post_grad_y(g, state, a_post, bias, seed, p, stream, n, y_dtype):
    g, state = _prepared(g, state)
    t, width = g.shape
    g_y = g.new_empty(t, width // n, dtype=y_dtype)
    _launch_post_bwd(g, g, state, a_post, a_post, a_post, bias, g_y, seed, p, stream, n, 0,
                     state, state, g_y, False, reduce=False)
    return g_y


def _launch_post_bwd(g, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations,
                     g_state, shares, g_y, h_res_transposed, reduce, dev=False):
    t, width = g.shape
    nb = next_pow2(n)
    # g_y alone holds no [n, n] tile: a wider step keeps as many bytes in flight as the grid needs
    bc = block_c(width // n, 1024 // (nb * nb) if reduce else 512 // nb)
    _post_bwd[(triton.cdiv(t, CHAIN_ROWS),)](
        g, x, state, bias, a_pre, a_post, a_res, y, seed if seed is not None else g, g_state,
        shares, g_y, stream, t, width // n, float(width) ** 0.5, iterations, N=n, NP=nb,
        BT=CHAIN_ROWS, BC=bc, EPS=SINKHORN_EPS, RMS=RMS_EPS,
        HT=h_res_transposed, REDUCE=reduce, IP=_kept(iterations), DEV=dev,
        **_dropout_args(seed, p))


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
def _rms_rows(g_ptr, x_ptr, w_ptr, rows, rmask, c, C):
    """One ``[R, BC]`` tile of the rows' g and x, the weight's ``[BC]``, and where they lie."""
    mask = rmask[:, None] & (c < C)[None, :]
    off = rows[:, None] * C + c[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    return g, x, w, off, mask


@triton.jit
def _rms_bwd(g_ptr, x_ptr, w_ptr, gx_ptr, gw_part_ptr, T, C, eps, R: tl.constexpr, BC: tl.constexpr):
    """``R`` rows per program; writes g_x and the program's share of g_weight (one row of partials)."""
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    rmask = rows < T
    ss = tl.zeros([R], dtype=tl.float32)
    dot = tl.zeros([R], dtype=tl.float32)
    for c0 in range(0, C, BC):
        g, x, w, off, mask = _rms_rows(g_ptr, x_ptr, w_ptr, rows, rmask, c0 + tl.arange(0, BC), C)
        ss += tl.sum(x * x, axis=1)
        dot += tl.sum(g * w[None, :] * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / C + eps)
    mean_gx = dot * rstd / C  # mean(g_xhat * xhat)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        g, x, w, off, mask = _rms_rows(g_ptr, x_ptr, w_ptr, rows, rmask, c, C)
        xhat = x * rstd[:, None]
        gx = rstd[:, None] * (g * w[None, :] - xhat * mean_gx[:, None])
        tl.store(gx_ptr + off, gx, mask=mask)
        tl.store(gw_part_ptr + pid * C + c, tl.sum(g * xhat, axis=0), mask=c < C)


_RMS_ROWS = 4  # rows per program of the norm's backward: a grid of T / 4 fills the GPU


def rms_norm(x, weight, eps):
    x, weight = _prepared(x, weight)
    t, c = x.shape
    out = torch.empty_like(x)
    _rms_fwd[(t,)](x, weight, out, c, float(eps), BC=block_c(c, 1024))
    return out


def rms_norm_backward(g, x, weight, eps):
    g, x, weight = _prepared(g, x, weight)
    t, c = x.shape
    programs = triton.cdiv(t, _RMS_ROWS)
    g_x = torch.empty_like(x)
    part = x.new_empty(programs, c, dtype=torch.float32)
    _rms_bwd[(programs,)](g, x, weight, g_x, part, t, c, float(eps), R=_RMS_ROWS,
                          BC=block_c(c, 256))
    return g_x, part.sum(0).to(weight.dtype)  # a fixed-order sum: deterministic


# ---- the loss: cross entropy over the vocabulary ----------------------------------------------------

_CE_LOW = -1.0e30  # below any logit, and exp(_CE_LOW - m) is 0 without an inf - inf


@triton.jit
def _ce_fwd(logits_ptr, targets_ptr, loss_ptr, lse_ptr, V, BV: tl.constexpr, LOW: tl.constexpr):
    """One row: its log-sum-exp in one pass (a running max and sum per lane), and its loss."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    m = tl.full([BV], LOW, tl.float32)
    s = tl.zeros([BV], dtype=tl.float32)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        x = tl.load(base + v, mask=v < V, other=LOW).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.where(v < V, tl.exp(x - m_new), 0.0)
        m = m_new
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    target = tl.load(targets_ptr + row)
    picked = tl.load(base + target).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, lse - picked)


@triton.jit
def _ce_bwd(g_ptr, logits_ptr, targets_ptr, lse_ptr, grad_ptr, V, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(g_ptr + row).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    target = tl.load(targets_ptr + row)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        x = tl.load(logits_ptr + row * V + v, mask=v < V, other=0.0).to(tl.float32)
        p = tl.exp(x - lse) - tl.where(v == target, 1.0, 0.0)
        tl.store(grad_ptr + row * V + v, p * g, mask=v < V)


_CE_BLOCK = 2048  # vocabulary entries per step: 8 per thread at 8 warps


def cross_entropy(logits, targets):
    logits, targets = _prepared(logits, targets, int32_indexed=False)  # rows in int64
    t, v = logits.shape
    loss = logits.new_empty(t, dtype=torch.float32)
    lse = logits.new_empty(t, dtype=torch.float32)
    _ce_fwd[(t,)](logits, targets, loss, lse, v, BV=min(_CE_BLOCK, triton.next_power_of_2(v)),
                  LOW=_CE_LOW, num_warps=8)
    return loss, lse


def cross_entropy_backward(g, logits, targets, lse, out=None):
    # ``out`` may be the logits: each program reads a chunk of its row before it writes it
    g, logits, targets, lse = _prepared(g, logits, targets, lse, int32_indexed=False)
    t, v = logits.shape
    grad = _written(out, lambda: torch.empty_like(logits))
    _ce_bwd[(t,)](g, logits, targets, lse, grad, v, BV=min(_CE_BLOCK, triton.next_power_of_2(v)),
                  num_warps=8)
    return _deliver(grad, out)
