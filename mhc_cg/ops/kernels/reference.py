"""The fused mHC ops in plain torch: the CPU path and the oracle the Triton kernels are tested on.

Every function takes token-major 2-D views (T tokens; the callers in ``mhc_cg.ops.kernels.custom_ops``
flatten ``[s, b, ...]``) and computes in fp32, or fp64 for fp64 inputs, casting the results to
the input dtype, exactly as the Triton kernels do. Backward functions are the explicit
derivatives (no autograd inside): the same formulas the kernels implement.

Shapes: ``x [T, n*C]`` stream-major, ``y [T, C]``, the mapping weight ``[m, n*C]`` with
``m = n*n + 2n`` (output columns ``[pre | post | res]``), the state ``[T, m+2]`` (below),
``h_pre``/``h_post [T, n]``, ``h_res [T, n, n]``.

H_res's layout (``h_res_transposed``): False, the residual mix is ``H_res x`` (``out[i] =
sum_j h_res[i, j] x[j]``, Megatron-LM main); True, ``H_res^T x`` (``out[i] = sum_j h_res[j, i]
x[j]``, Megatron-LM dev). Only the ops that apply H_res take it: the post, its backward, the
pre's backward (x's gradient through the post) and the block recompute.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mhc_cg.ops.kernels.hash import counter_hash, keep_bits, keep_threshold, keep_scale, seed32

SINKHORN_EPS = 1e-6
RMS_EPS = 1e-6
H_PRE_EPS = 1e-6  # dev's h_pre floor (DeepSeek-V4's pre = sigmoid + eps)
# main: the paper's, as Megatron-LM main computes it; dev: DeepSeek-V4's, as Megatron-LM dev does
ARITHMETICS = ("main", "dev")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The mapping state is kept in the compute dtype: fp32 (fp64 for fp64 models)."""
    return compute_dtype(dtype)


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


def h_pre_of(h: Tensor, n: int, arithmetic: str = "main") -> Tensor:
    """H_pre from the logits ``h [T, m]``: ``sigmoid``, and dev's ``+ 1e-6`` (its derivative is
    the sigmoid's either way)."""
    s = torch.sigmoid(h[:, :n])
    return s + H_PRE_EPS if arithmetic == "dev" else s


def sinkhorn_init(logits: Tensor) -> Tensor:
    return torch.exp(logits - logits.amax(dim=-1, keepdim=True))


def _normalise(m: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``(m / max(sum(m, dim), eps), sum(m, dim))``."""
    s = m.sum(dim=dim, keepdim=True)
    return m / s.clamp_min(SINKHORN_EPS), s


def _normalise_backward(g: Tensor, out: Tensor, s: Tensor, dim: int) -> Tensor:
    """Through ``out = m / max(s, eps)``, ``s = sum(m, dim)``, for gradients with respect to the
    logarithm (``g * out`` in, ``g_m * m`` out): no division, so an entry of m that underflows
    towards 0 cannot blow the gradient up; no path through a clamped ``s``."""
    return g - out * (g.sum(dim=dim, keepdim=True) * (s >= SINKHORN_EPS))


def sinkhorn(logits: Tensor, iterations: int, arithmetic: str = "main") -> Tensor:
    """Megatron-LM main's: row then column normalisation, ``iterations`` times, from
    ``exp(L - rowmax)``, each sum clamped at eps. ``arithmetic="dev"``: Megatron-LM dev's
    (DeepSeek-V4's) :func:`sinkhorn_dev`."""
    if arithmetic == "dev":
        return sinkhorn_dev(logits, iterations)
    m = sinkhorn_init(logits)
    for _ in range(iterations):
        m = _normalise(m, -1)[0]
        m = _normalise(m, -2)[0]
    return m


# Note [dev's Sinkhorn]: Megatron-LM dev (DeepSeek-V4's hc_split_sinkhorn) starts from
# softmax(L) + eps, normalises the columns, then runs iterations - 1 row and column rounds, every
# sum + eps (not clamped): T row and T column normalisations in all, the first row one the
# softmax's. Each step out = m / (s + eps) has the derivative (g - sum(g out)) / (s + eps), whose
# denominator is never below eps, so no log-space trick is needed (every m >= eps / (n + eps)).

def _dev_steps(logits: Tensor, iterations: int):
    """``(softmax, [(m, out, s, dim)] of every normalisation after it)`` of dev's Sinkhorn."""
    p = torch.softmax(logits, dim=-1)
    m, steps = p + SINKHORN_EPS, []
    for dim in (-2, *((-1, -2) * (iterations - 1))):
        s = m.sum(dim=dim, keepdim=True)
        out = m / (s + SINKHORN_EPS)
        steps.append((out, s, dim))
        m = out
    return p, steps


def sinkhorn_dev(logits: Tensor, iterations: int) -> Tensor:
    """Megatron-LM dev's Sinkhorn (Note [dev's Sinkhorn])."""
    return _dev_steps(logits, iterations)[1][-1][0]


def sinkhorn_dev_backward(logits: Tensor, grad: Tensor, iterations: int) -> Tensor:
    """d :func:`sinkhorn_dev` / d logits, recomputing the iterates from the logits."""
    p, steps = _dev_steps(logits, iterations)
    g = grad
    for out, s, dim in reversed(steps):
        g = (g - (g * out).sum(dim=dim, keepdim=True)) / (s + SINKHORN_EPS)
    return p * (g - (g * p).sum(dim=-1, keepdim=True))


def sinkhorn_backward(logits: Tensor, grad: Tensor, iterations: int,
                      arithmetic: str = "main") -> Tensor:
    """d sinkhorn / d logits, recomputing the iterates from the logits (kept only inside this call)."""
    if arithmetic == "dev":
        return sinkhorn_dev_backward(logits, grad, iterations)
    m0 = sinkhorn_init(logits)
    steps = []  # (out, s, dim) of every half-step, in order
    m = m0
    for _ in range(iterations):
        for dim in (-1, -2):
            out, s = _normalise(m, dim)
            steps.append((out, s, dim))
            m = out
    # m's gradient grows as 1/m where logits spread past exp's range (overflowing fp32); its
    # product with m, the gradient with respect to log m, keeps the result's scale
    g = grad * m
    for out, s, dim in reversed(steps):
        g = _normalise_backward(g, out, s, dim)
    # m0 = exp(L - max): the max's share goes to the maxima, split evenly between ties (as amax's)
    g_l = g
    is_max = logits == logits.amax(dim=-1, keepdim=True)
    g_max = -g_l.sum(dim=-1, keepdim=True)
    return g_l + is_max * (g_max / is_max.sum(dim=-1, keepdim=True))


# ---- the fused sublayer: pre (mappings, aggregate, norm) and post (H_res, H_post, dropout, add) ------
#
# The state of a token is ``[proj (m) | xnorm | rstd]``: the mapping projection ``x W^T``, the L2
# norm of x and the RMSNorm scale of F's input. All three come from the one read of x that the
# projection needs: ``rstd`` through the streams' Gram matrix ``G = X X^T`` (n x n per token), as
# ``|sum_i h_pre[i] x[i]|^2 = h_pre^T G h_pre``. Every mapping, and F's input from x, is then a
# function of the state: the forward, the post and the block recompute all read it, none redoes a
# reduction over the token's features.

def state_width(mapping_size: int) -> int:
    """Columns of the state: the projection's ``m = n*n + 2n``, then xnorm and rstd."""
    return mapping_size + 2


def dropout_keep_scaled(seed: Tensor | None, stream: int, p: float, t: int, width: int,
                        device: torch.device) -> Tensor | None:
    """``keep / (1 - p)`` (fp32) for the ``[t, width]`` output, or None without dropout."""
    if seed is None or p == 0.0:
        return None
    index = torch.arange(t * width, dtype=torch.int32, device=device).view(t, width)
    keep = keep_bits(counter_hash(seed32(seed), stream, index)) >= keep_threshold(p)
    return keep.to(torch.float32) * keep_scale(p)


def _split_state(state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return state[:, :-2], state[:, -2], state[:, -1]


def logits_of(state: Tensor, a_pre, a_post, a_res, bias, n: int, sqrt_d: float):
    """``h = r * proj * scale + bias`` from the state; returns (h, r, proj, scale)."""
    proj, xnorm, _ = _split_state(state)
    return _logits(proj, xnorm, a_pre, a_post, a_res, bias, n, sqrt_d)


def mapping_state(x: Tensor, weight: Tensor, a_pre, a_post, a_res, bias, n: int, eps: float,
                  norm: bool, arithmetic: str = "main") -> Tensor:
    """The state ``[proj | xnorm | rstd]`` of every token (``rstd`` is 1 without a norm)."""
    acc = compute_dtype(x.dtype)
    xa = x.to(acc)
    xv = xa.unflatten(1, (n, -1))
    gram = xv @ xv.transpose(1, 2)
    proj = xa @ weight.to(acc).t()
    xnorm = torch.diagonal(gram, dim1=1, dim2=2).sum(1).sqrt()
    rstd = torch.ones_like(xnorm)
    if norm:
        h, _, _, _ = _logits(proj, xnorm, a_pre, a_post, a_res, bias, n, math.sqrt(x.shape[1]))
        s = h_pre_of(h, n, arithmetic)
        mean_sq = (s[:, None, :] @ gram @ s[:, :, None]).view(-1) / xv.shape[2]
        rstd = torch.rsqrt(mean_sq.clamp_min(0.0) + eps)
    return torch.cat([proj, xnorm[:, None], rstd[:, None]], dim=1)


def _aggregate(xv: Tensor, h_pre: Tensor) -> Tensor:
    return (h_pre[:, :, None] * xv).sum(1)


def _into(value: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


def fn_input(x: Tensor, state: Tensor, a_pre, a_post, a_res, bias, norm_weight: Tensor | None,
             n: int, fn_input_out: Tensor | None = None, arithmetic: str = "main") -> Tensor:
    """F's input ``rstd * norm_weight * sum_i h_pre[i] x[i]`` (no norm when ``norm_weight`` is
    None), h_pre and rstd from the state: the forward and the recompute compute it the same way."""
    acc = compute_dtype(x.dtype)
    h, _, _, _ = logits_of(state, a_pre, a_post, a_res, bias, n, math.sqrt(x.shape[1]))
    agg = _aggregate(x.to(acc).unflatten(1, (n, -1)), h_pre_of(h, n, arithmetic))
    if norm_weight is not None:
        agg = agg * state[:, -1:].to(acc) * norm_weight.to(acc)
    return _into(agg.to(x.dtype), fn_input_out)


def pre(x: Tensor, weight: Tensor, a_pre, a_post, a_res, bias, norm_weight: Tensor | None, n: int,
        iterations: int, eps: float, fn_input_out: Tensor | None = None,
        state_out: Tensor | None = None, arithmetic: str = "main") -> tuple[Tensor, Tensor]:
    """``(F's input, state)`` (written into the ``*_out`` buffers when given)."""
    state = _into(mapping_state(x, weight, a_pre, a_post, a_res, bias, n, eps,
                                norm_weight is not None, arithmetic), state_out)
    return _into(fn_input(x, state, a_pre, a_post, a_res, bias, norm_weight, n,
                          arithmetic=arithmetic), fn_input_out), state


def _state_backward(g_h: Tensor, h, r, proj, scale, n: int, sqrt_d: float):
    """From ``g_h`` (the logits' gradient) to ``(g_state [T, m+2], param shares [T, m+3])``."""
    g_proj = g_h * scale * r[:, None]
    g_xnorm = (g_h * scale * proj).sum(dim=1) * (-r * r / sqrt_d)
    g_scale = g_h * r[:, None] * proj
    alphas = torch.stack([g_scale[:, :n].sum(1), g_scale[:, n:2 * n].sum(1),
                          g_scale[:, 2 * n:].sum(1)], 1)
    zero = torch.zeros_like(g_xnorm)
    return torch.cat([g_proj, g_xnorm[:, None], zero[:, None]], 1), torch.cat([g_h, alphas], 1)


def pre_backward(g_out: Tensor, g_state: Tensor | None, g_post: Tensor | None, x: Tensor,
                 weight: Tensor, a_pre, a_post, a_res, bias, norm_weight: Tensor | None,
                 state: Tensor, n: int, iterations: int, eps: float, g_x_out: Tensor | None = None,
                 *, h_res_transposed: bool = False, post: tuple | None = None,
                 prev: tuple | None = None, g_y_out: Tensor | None = None,
                 arithmetic: str = "main"):
    """``(g_x, g_weight, param shares [T, m+3], norm weight shares [T, C])`` of :func:`pre`, and of
    the post's residual path: ``g_x`` includes ``H_res^T g_post`` (``H_res g_post`` for the
    transposed layout).

    Two halves of the posts around it, where they run here instead (same bits either way):
    ``post = (y, seed, p, stream)``, the sublayer's own post: its reductions
    (:func:`post_reductions`), from the x and g_post read here anyway, go into the state's
    gradient and the shares. ``prev = (state, a_post, bias, seed, p, stream)``, the post that
    wrote x: its F output's gradient (:func:`post_grad_y`) from the g_x written here, into
    ``g_y_out``.

    ``g_state`` is the gradient the state's consumers sent back (its rstd column included;
    ``None``: none did, as where the state's one consumer is the post whose reductions run here),
    ``g_post`` the gradient of the sublayer's output (the post's backward leaves the residual
    path to this op, so the stream's gradient is summed here, in one pass); ``g_weight`` is the
    mapping weight's, ``g_proj^T x`` in the compute dtype (``g_proj`` the projection's total
    gradient), so x is read here and not again by a GEMM of its own. ``g_x_out`` given: x's
    gradient is written there (it may be ``g_post`` itself)."""
    acc = compute_dtype(x.dtype)
    sqrt_d = math.sqrt(x.shape[1])
    xa = x.to(acc)
    xv = xa.unflatten(1, (n, -1))
    c = xv.shape[2]
    h, r, proj, scale = logits_of(state, a_pre, a_post, a_res, bias, n, sqrt_d)
    s_pre = torch.sigmoid(h[:, :n])
    agg = _aggregate(xv, h_pre_of(h, n, arithmetic))
    g = g_out.to(acc)
    g_state = None if g_state is None else g_state.to(acc)
    shares_post = None
    if post is not None:
        y, seed, p, stream = post
        g_state_post, shares_post = post_reductions(
            g_post, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations,
            h_res_transposed=h_res_transposed, arithmetic=arithmetic)
        g_state = g_state_post if g_state is None else g_state + g_state_post
    elif g_state is None:
        g_state = torch.zeros_like(state, dtype=acc)
    if norm_weight is None:
        g_agg, g_w = g, torch.zeros(0, dtype=acc, device=x.device)
    else:
        w = norm_weight.to(acc)
        rstd = state[:, -1:].to(acc)
        gw = g * w
        # rstd = (|agg|^2 / C + eps)^-1/2: through F's input and through the state's column
        kappa = rstd ** 3 * ((gw * agg).sum(-1, keepdim=True) + g_state[:, -1:]) / c
        g_agg = rstd * gw - kappa * agg
        g_w = g * agg * rstd
    g_h = torch.zeros_like(h)
    g_h[:, :n] = (xv * g_agg[:, None, :]).sum(-1) * s_pre * (1.0 - s_pre)
    g_own, shares = _state_backward(g_h, h, r, proj, scale, n, sqrt_d)
    g_proj, g_xnorm, _ = _split_state(g_own + g_state)
    xnorm = state[:, -2].to(acc)
    coef = torch.where(xnorm > 0, g_xnorm / xnorm.clamp_min(torch.finfo(acc).tiny), 0.0)
    g_xa = (h_pre_of(h, n, arithmetic)[:, :, None] * g_agg[:, None, :]).flatten(1) \
        + g_proj @ weight.to(acc) + coef[:, None] * xa
    if g_post is not None:
        h_res = sinkhorn(h[:, 2 * n:].unflatten(-1, (n, n)), iterations, arithmetic)
        g_xa = g_xa + torch.matmul(h_res if h_res_transposed else h_res.transpose(1, 2),
                                   g_post.to(acc).unflatten(1, (n, -1))).flatten(1)
    g_weight = (g_proj.t() @ xa).to(weight.dtype)
    if shares_post is not None:  # the post's columns and the pre's are disjoint: no sum rounds
        shares = shares + shares_post
    g_x = g_xa.to(x.dtype)
    if prev is not None:
        prev_state, prev_a_post, prev_bias, seed, p, stream = prev
        _into(post_grad_y(g_x, prev_state, prev_a_post, prev_bias, seed, p, stream, n,
                          g_y_out.dtype), g_y_out)
    return _into(g_x, g_x_out), g_weight, shares, g_w


def _post_mappings(state, a_pre, a_post, a_res, bias, n: int, iterations: int, sqrt_d: float,
                   arithmetic: str = "main"):
    h, r, proj, scale = logits_of(state, a_pre, a_post, a_res, bias, n, sqrt_d)
    s_post = torch.sigmoid(h[:, n:2 * n])
    h_res = sinkhorn(h[:, 2 * n:].unflatten(-1, (n, n)), iterations, arithmetic)
    return h, r, proj, scale, s_post, h_res


def post_maps(states: Tensor, bias: Tensor, a_post: Tensor, a_res: Tensor, width: int, n: int,
              iterations: int, arithmetic: str = "main") -> Tensor:
    """``[s_post | H_res]`` (``[P, T, n + n*n]``, ``s_post = H_post / 2``) of every post ``k``
    from ``states[k]``, ``bias[k]``, ``a_post[k]``, ``a_res[k]``."""
    maps = states.new_empty(states.shape[0], states.shape[1], n + n * n)
    for k in range(states.shape[0]):
        a_post_k = a_post[k:k + 1]  # the pre's logits go unused: a_post stands in for a_pre
        *_, s_post, h_res = _post_mappings(states[k], a_post_k, a_post_k, a_res[k:k + 1], bias[k],
                                           n, iterations, math.sqrt(width), arithmetic)
        maps[k] = torch.cat([s_post, h_res.flatten(1)], 1)
    return maps


def post(x: Tensor, state: Tensor, a_pre, a_post, a_res, bias, y: Tensor, seed: Tensor | None,
         p: float, stream: int, n: int, iterations: int, out: Tensor | None = None, *,
         h_res_transposed: bool = False, maps: Tensor | None = None,
         arithmetic: str = "main") -> Tensor:
    """``out[i] = sum_j h_res[i, j] x[j] + dropout(h_post[i] y)`` (``h_res[j, i]`` transposed),
    the mappings from ``maps`` (:func:`post_maps`), or from the state."""
    acc = compute_dtype(x.dtype)
    t = x.shape[0]
    if maps is None:
        maps = post_maps(state[None], bias[None], a_post, a_res, x.shape[1], n, iterations,
                         arithmetic)[0]
    s_post, h_res = maps[:, :n].to(acc), maps[:, n:].unflatten(-1, (n, n)).to(acc)
    mixed = torch.matmul(h_res.transpose(1, 2) if h_res_transposed else h_res,
                         x.to(acc).unflatten(1, (n, -1))).flatten(1)
    branch = (2.0 * s_post[:, :, None] * y.to(acc)[:, None, :]).flatten(1)
    mask = dropout_keep_scaled(seed, stream, p, t, x.shape[1], x.device)
    if mask is not None:
        branch = branch * mask.to(acc)
    return _into((mixed + branch).to(x.dtype), out)


def post_state(x: Tensor, maps: Tensor, y: Tensor, seed: Tensor | None, p: float, stream: int,
               n: int, weight: Tensor, a_pre, bias, norm: bool, eps: float,
               out: Tensor | None = None, state_out: Tensor | None = None, *,
               h_res_transposed: bool = False, arithmetic: str = "main") -> tuple[Tensor, Tensor]:
    """``(post's output, the next pre's state)``: :func:`post` with ``maps``, then the state of
    what it wrote as the next pre (``weight``, ``a_pre``, ``bias``) would compute it."""
    result = post(x, None, None, None, None, None, y, seed, p, stream, n, 0, out,
                  h_res_transposed=h_res_transposed, maps=maps)
    # only the pre's columns of the logits feed the state (rstd): a_pre stands in for the rest
    state = mapping_state(result, weight, a_pre, a_pre, a_pre, bias, n, eps, norm, arithmetic)
    return result, _into(state, state_out)


def post_reductions(g: Tensor, x: Tensor, state: Tensor, a_pre, a_post, a_res, bias, y: Tensor,
                    seed: Tensor | None, p: float, stream: int, n: int, iterations: int, *,
                    h_res_transposed: bool = False,
                    arithmetic: str = "main") -> tuple[Tensor, Tensor]:
    """``(g_state, param shares [T, m+3])`` of :func:`post`: its per-token reductions (``g . x``
    through H_res, ``g . y`` through H_post), the half of its backward that reads x and y."""
    acc = compute_dtype(x.dtype)
    sqrt_d = math.sqrt(x.shape[1])
    h, r, proj, scale, s_post, h_res = _post_mappings(state, a_pre, a_post, a_res, bias, n,
                                                      iterations, sqrt_d, arithmetic)
    gv = g.to(acc).unflatten(1, (n, -1))
    xv = x.to(acc).unflatten(1, (n, -1))
    # d out[i] / d h_res[i, j] = x[j]; transposed, d out[j] / d h_res[i, j] = x[i]
    g_h_res = torch.matmul(xv, gv.transpose(1, 2)) if h_res_transposed else \
        torch.matmul(gv, xv.transpose(1, 2))
    gm = _masked(gv, seed, stream, p)
    g_h = torch.zeros_like(h)
    g_h[:, n:2 * n] = (gm * y.to(acc)[:, None, :]).sum(-1) * 2.0 * s_post * (1.0 - s_post)
    g_h[:, 2 * n:] = sinkhorn_backward(h[:, 2 * n:].unflatten(-1, (n, n)), g_h_res,
                                       iterations, arithmetic).flatten(1)
    return _state_backward(g_h, h, r, proj, scale, n, sqrt_d)


def post_grad_y(g: Tensor, state: Tensor, a_post, bias, seed: Tensor | None, p: float,
                stream: int, n: int, y_dtype: torch.dtype) -> Tensor:
    """F's output's gradient through :func:`post`, ``sum_i H_post[i] mask[i] g[i]``: the half of
    its backward that F's backward waits for, from g alone (the pre's backward after the post
    computes it from the gradient it writes, :func:`pre_backward`'s ``prev``)."""
    h, *_ = logits_of(state, a_post, a_post, a_post, bias, n, math.sqrt(g.shape[1]))
    s_post = torch.sigmoid(h[:, n:2 * n])
    gm = _masked(g.to(compute_dtype(g.dtype)).unflatten(1, (n, -1)), seed, stream, p)
    return (2.0 * s_post[:, :, None] * gm).sum(1).to(y_dtype)


def _masked(gv: Tensor, seed: Tensor | None, stream: int, p: float) -> Tensor:
    """A post output's gradient ``[T, n, C]`` through the post's dropout mask."""
    t, n, c = gv.shape
    mask = dropout_keep_scaled(seed, stream, p, t, n * c, gv.device)
    return gv if mask is None else gv * mask.to(gv.dtype).unflatten(1, (n, -1))


def post_backward(g: Tensor, x: Tensor, state: Tensor, a_pre, a_post, a_res, bias, y: Tensor,
                  seed: Tensor | None, p: float, stream: int, n: int, iterations: int, *,
                  h_res_transposed: bool = False, arithmetic: str = "main"):
    """``(g_state, param shares [T, m+3], g_y)`` of :func:`post` (the state's rstd column, which
    the post does not read, gets 0). x's gradient ``H_res^T g`` is left to :func:`pre_backward`,
    which writes the stream's whole gradient at once."""
    g_state, shares = post_reductions(g, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream,
                                      n, iterations, h_res_transposed=h_res_transposed,
                                      arithmetic=arithmetic)
    return g_state, shares, post_grad_y(g, state, a_post, bias, seed, p, stream, n, y.dtype)


def recompute(x0: Tensor, ys: Tensor, states: Tensor, params: Tensor, norm_weights: Tensor | None,
              seed: Tensor | None, p: float, streams: list[int], n: int, iterations: int,
              eps: float, x_out: Tensor, fn_input_out: Tensor, *,
              h_res_transposed: bool = False, maps: Tensor | None = None,
              arithmetic: str = "main") -> None:
    """A block's mHC chain from its input: per sublayer k, F's input into ``fn_input_out[k]``
    and, but for the last, its output (the next sublayer's input) into ``x_out[k]``.
    ``ys [S, T, C]`` are F's outputs, ``states [S, T, m+2]``, ``params [S, m+3]``
    (``bias | a_pre, a_post, a_res``), ``norm_weights [S, C]`` (None: no norm); ``maps [S-1, T,
    n + n*n]`` the posts' mappings (:func:`post_maps`; None: from the states)."""
    x = x0
    m = states.shape[2] - 2
    for k in range(ys.shape[0]):
        bias, a = params[k, :m], params[k, m:]
        fn_input_out[k].copy_(fn_input(x, states[k], a[0:1], a[1:2], a[2:3], bias,
                                       None if norm_weights is None else norm_weights[k], n,
                                       arithmetic=arithmetic))
        if k + 1 < ys.shape[0]:
            x = post(x, states[k], a[0:1], a[1:2], a[2:3], bias, ys[k], seed, p, streams[k], n,
                     iterations, x_out[k], h_res_transposed=h_res_transposed,
                     maps=None if maps is None else maps[k], arithmetic=arithmetic)


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


# ---- the loss: cross entropy over the vocabulary ---------------------------------------------------
#
# F.cross_entropy on a model's low-precision logits upcasts all of them to fp32, keeps the fp32
# log-probabilities for its backward and makes two more fp32 [T, V] tensors there: at seq 2048 x
# micro-batch 2 and a 32000 vocabulary that is 1.5 GiB at once, the step's peak. Here the fp32
# values exist one chunk of rows at a time; the forward keeps the logits it was given (the model
# already made them) and each row's log-sum-exp, the backward writes the logits' gradient in their
# dtype.

CE_CHUNK_BYTES = 64 * 2 ** 20  # the fp32 rows one chunk upcasts at once


def _ce_rows(t: int, v: int) -> int:
    return max(1, min(t, CE_CHUNK_BYTES // (4 * max(v, 1))))


def cross_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``(loss [T], lse [T])`` in the compute dtype: ``lse - logits[t, target]`` per row."""
    acc = compute_dtype(logits.dtype)
    t, v = logits.shape
    lse = logits.new_empty(t, dtype=acc)
    rows = _ce_rows(t, v)
    for r0 in range(0, t, rows):
        lse[r0:r0 + rows] = torch.logsumexp(logits[r0:r0 + rows].to(acc), dim=-1)
    picked = logits.gather(1, targets[:, None]).squeeze(1).to(acc)
    return lse - picked, lse


def cross_entropy_backward(g: Tensor, logits: Tensor, targets: Tensor, lse: Tensor,
                           out: Tensor | None = None) -> Tensor:
    """The logits' gradient ``g[t] * (softmax(logits[t]) - onehot(target[t]))``, in their dtype,
    into ``out`` if given (the logits themselves may be: a chunk's rows are read first)."""
    acc = compute_dtype(logits.dtype)
    t, v = logits.shape
    grad = torch.empty_like(logits) if out is None else out
    rows = _ce_rows(t, v)
    for r0 in range(0, t, rows):
        sl = slice(r0, r0 + rows)
        p = torch.exp(logits[sl].to(acc) - lse[sl, None])
        p.scatter_add_(1, targets[sl, None], torch.full_like(p[:, :1], -1.0))
        grad[sl] = p * g[sl, None].to(acc)
    return grad
