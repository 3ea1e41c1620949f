"""The fused mHC ops as ``torch.library`` custom ops (namespace ``mhc_cg``).

Each op is one opaque node for autograd, ``torch.compile``, ``TorchDispatchMode`` recorders (the
graph tape sees ``torch.ops.mhc_cg.<name>.default``) and the ``meta`` device (fake
implementations). Forward and backward are one op each; the boolean ``use_triton`` argument picks
the Triton kernels (``mhc_cg.ops.kernels.triton_kernels``) or the torch reference
(``mhc_cg.ops.kernels.reference``). Every op takes token-major 2-D tensors; ``mhc_cg.ops.kernels``
flattens and restores the ``[s, b, ...]`` layout around them with views. The ops that apply H_res
take ``h_res_transposed`` last (default False: ``H_res x``; True: ``H_res^T x``, see
``reference``), so a call without it keeps today's layout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mhc_cg.ops.kernels import reference
from mhc_cg.ops.kernels.reference import state_dtype, state_width


# What a fused op's Triton kernels do beyond one pass over each tensor, for the cost model: the
# launches it makes (the pre: its state's two stages, then its F-input pass; a post that makes
# the next state: the post with the state's first stage, then its second; the pre's backward: a
# pass per token, then one per feature chunk and group of tokens), the arguments a second pass reads again
# (the pre reads x twice; its backward reads x and g_out in both of its passes) and the bytes its
# kernels hand each other through memory (``scratch_bytes``).
LAUNCHES = {"mhc_cg::pre": 3, "mhc_cg::pre_into": 3, "mhc_cg::post_state": 2,
            "mhc_cg::post_state_into": 2, "mhc_cg::pre_backward": 2,
            "mhc_cg::pre_backward_into": 2}
READ_TWICE = {"mhc_cg::pre": ("x",), "mhc_cg::pre_into": ("x",),
              "mhc_cg::pre_backward": ("x", "g_out"),
              "mhc_cg::pre_backward_into": ("x", "g_out")}


def read_twice(name: str, args: dict) -> tuple[str, ...]:
    """The arguments op ``name``'s kernels read twice in this call: the pre's backward with its
    post's reductions (``y`` given) reads g_post in its first pass as well."""
    twice = READ_TWICE.get(name, ())
    if name.startswith("mhc_cg::pre_backward") and args.get("y") is not None:
        twice += ("g_post",)
    return twice

DOT_ROWS = 16  # tokens per Triton program where a kernel multiplies by the mapping weight (tl.dot)
SUM_ROWS = 4  # tokens per program of the state's second stage
# Programs a kernel's grid should have at least: 4 per SM of an H100 or H200 (132 SMs), so that
# every SM holds several blocks to hide latency with
MIN_PROGRAMS = 4 * 132


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_c(c: int, budget: int) -> int:
    """Features per step: ``budget`` elements over the tile's other axes, 16 to the width of C."""
    return max(16, min(next_pow2(c), next_pow2(budget)))


def mapping_columns(n: int) -> int:
    """The mappings' ``n^2 + 2n`` columns padded to a power of two, at least 16 (``tl.dot``)."""
    return max(16, next_pow2(n * n + 2 * n))


# The state's first stage holds a [rows, NP, NP, BC] Gram product per step: its features per step
# shrink as its tokens per program grow, so the tile keeps the same registers
STATE_TILE = 8192


def state_rows(x_bytes: int, weight_bytes: int, rows: int | None = None) -> int:
    """Tokens per program of the state's first stage (``rows`` given: that). Note [wide token
    tiles]: each program reads the mapping weight's m rows over its features once for its
    tokens, so the weight's reads are ``m * size(w) / (rows * size(x))`` of x's: 64 tokens keep
    them at 0.375 of x for weights in x's dtype, 128 for fp32 weights beside bf16 x."""
    if rows is not None:
        return rows
    return 64 if weight_bytes <= x_bytes else 128


def state_tiling(c: int, n: int, rows: int) -> tuple[int, int, int]:
    """``(NP, MP, BC)`` of the state kernels at ``rows`` tokens per program: streams and mapping
    columns padded to powers of two, features per step (the dot's depth ``NP * BC`` at least
    16)."""
    np_ = next_pow2(n)
    bc = max(16 // np_, min(next_pow2(c), next_pow2(max(1, STATE_TILE // (rows * np_ * np_)))))
    return np_, mapping_columns(n), bc


def state_splits(tokens: int, c: int, bc: int, rows: int,
                 splits: int | None = None) -> tuple[int, int]:
    """``(splits, features per split)`` of the state's first stage: whole ``bc`` steps per split;
    ``splits`` None: a power of two, enough that ``tokens / rows x splits`` programs reach
    :data:`MIN_PROGRAMS`; never more splits than steps, never an empty one."""
    steps = max(1, math.ceil(c / bc))
    blocks = max(1, math.ceil(tokens / rows))
    if splits is None:
        splits = next_pow2(math.ceil(MIN_PROGRAMS / blocks))
    splits = max(1, min(splits, next_pow2(steps)))
    while splits > 1 and math.ceil(steps / splits) * (splits - 1) >= steps:
        splits //= 2  # no empty split
    span = math.ceil(steps / splits) * bc
    return math.ceil(c / span), span


def state_scratch(tokens: int, c: int, n: int, m: int, rows: int) -> dict[str, tuple[int, ...]]:
    """The fp32 rows the state's first stage writes and its second sums: per split and token
    ``[proj (MP) | Gram matrix (NP * NP)]``."""
    np_, mp, bc = state_tiling(c, n, rows)
    return {"part": (state_splits(tokens, c, bc, rows)[0], tokens, mp + np_ * np_)}


def weight_grad_groups(tokens: int, c: int, m: int, n: int) -> tuple[int, int]:
    """``(groups, tokens per group)`` the pre's backward sums the mapping weight's gradient over
    (each group writes an fp32 ``[m, nC]`` partial, then summed in group order): enough groups
    that the second pass's grid (feature chunks x groups) reaches :data:`MIN_PROGRAMS`, never
    more partial bytes than an eighth of x's (``groups * m * 4 <= tokens * 2 / 8``); whole
    ``DOT_ROWS`` blocks per group."""
    blocks = max(1, math.ceil(tokens / DOT_ROWS))
    chunks = math.ceil(c / block_c(c, 128 // next_pow2(n)))
    want = max(1, min(blocks, math.ceil(MIN_PROGRAMS / chunks), tokens // (16 * max(m, 1))))
    per_group = math.ceil(blocks / want) * DOT_ROWS
    return math.ceil(blocks * DOT_ROWS / per_group), per_group


def post_backward_scratch(tokens: int, c: int, n: int, m: int) -> dict[str, tuple[int, ...]]:
    """The fp32 buffer the post's backward kernel writes and torch sums after it: per token the
    parameters' shares ``[bias (m) | alpha_pre, alpha_post, alpha_res]``."""
    return {"shares": (tokens, m + 3)}


def pre_backward_scratch(tokens: int, c: int, n: int, m: int, post: bool = False,
                         prev: bool = False) -> dict[str, tuple[int, ...]]:
    """The fp32 buffers the pre's backward kernels hand each other: per token the projection's
    gradient, the parameters' shares (as the post's) and the coefficients ``[kappa, coef, rstd,
    s | H_res]`` (and ``| s_prev`` with the previous post's F output gradient, ``prev``); per
    group of tokens the mapping weight's gradient; with the post's reductions (``post``), the
    state's gradient they are summed into."""
    groups, _ = weight_grad_groups(tokens, c, m, n)
    return {"g_proj": (tokens, m), **post_backward_scratch(tokens, c, n, m),
            "aux": (tokens, 3 + n + n * n + (n if prev else 0)), "g_weight": (groups, m, n * c),
            **({"g_state": (tokens, m + 2)} if post else {})}


def post_maps_shape(tokens: int, n: int, posts: int) -> tuple[int, int, int]:
    """:func:`post_maps`'s result: per post and token ``[H_post / 2 (n) | H_res (n*n)]``."""
    return posts, tokens, n + n * n


_SCRATCH = {"mhc_cg::post_backward": post_backward_scratch,
            "mhc_cg::pre_backward": pre_backward_scratch,
            "mhc_cg::pre_backward_into": pre_backward_scratch,
            **{name: state_scratch for name in ("mhc_cg::pre", "mhc_cg::pre_into",
                                                "mhc_cg::post_state", "mhc_cg::post_state_into")}}


def scratch_bytes(name: str, args: dict) -> int:
    """Bytes the Triton kernels of op ``name`` write and read back internally, beyond its
    arguments and results (its ``*_scratch`` buffers, fp32)."""
    shapes_of = _SCRATCH.get(name)
    if shapes_of is None:
        return 0
    t, width = args["x"].shape
    n = args["n"]
    m = args["weight"].shape[0] if "weight" in args else args["bias"].shape[0]
    if shapes_of is pre_backward_scratch:
        extra = {"post": args.get("y") is not None, "prev": args.get("prev_state") is not None}
    elif shapes_of is state_scratch:
        extra = {"rows": state_rows(args["x"].element_size(), args["weight"].element_size())}
    else:
        extra = {}
    return 2 * 4 * sum(math.prod(shape) for shape in shapes_of(t, width // n, n, m,
                                                               **extra).values())


# The fused ops that are no mHC work, which the cost model's mHC traffic leaves out: the model's
# final norm and its loss.
NOT_MHC = frozenset({"mhc_cg::rms_norm", "mhc_cg::rms_norm_backward", "mhc_cg::cross_entropy",
                     "mhc_cg::cross_entropy_backward", "mhc_cg::cross_entropy_backward_"})


def _impl(use_triton: bool):
    if use_triton:
        from mhc_cg.ops.kernels.dispatch import triton_kernels

        return triton_kernels()
    return reference


# ---- pre: mappings, aggregate and norm, from one read of x ----------------------------------------

@torch.library.custom_op("mhc_cg::pre", mutates_args=())
def pre(x: Tensor, weight: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor, bias: Tensor,
        norm_weight: Tensor | None, n: int, iterations: int, eps: float,
        use_triton: bool) -> tuple[Tensor, Tensor]:
    """``(F's input [T, C], state [T, m+2])``; see ``reference.pre``."""
    return _impl(use_triton).pre(x, weight, a_pre, a_post, a_res, bias, norm_weight, n,
                                 iterations, eps)


@pre.register_fake
def _(x, weight, a_pre, a_post, a_res, bias, norm_weight, n, iterations, eps, use_triton):
    return (x.new_empty(x.shape[0], x.shape[1] // n),
            x.new_empty(x.shape[0], state_width(weight.shape[0]), dtype=state_dtype(x.dtype)))


@torch.library.custom_op("mhc_cg::pre_into", mutates_args=("fn_input_out", "state_out"))
def pre_into(x: Tensor, weight: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
             bias: Tensor, norm_weight: Tensor | None, n: int, iterations: int, eps: float,
             use_triton: bool, fn_input_out: Tensor, state_out: Tensor) -> None:
    """:func:`pre` writing into buffers it is given (an arena slot, the persistent set)."""
    _impl(use_triton).pre(x, weight, a_pre, a_post, a_res, bias, norm_weight, n, iterations, eps,
                          fn_input_out, state_out)


@pre_into.register_fake
def _(x, weight, a_pre, a_post, a_res, bias, norm_weight, n, iterations, eps, use_triton,
      fn_input_out, state_out):
    return None


def _around(y, seed, p, stream, prev_state, prev_a_post, prev_bias, prev_stream):
    """The pre backward's ``post`` and ``prev`` (:func:`reference.pre_backward`) from its flat
    arguments."""
    post = None if y is None else (y, seed, p, stream)
    prev = None if prev_state is None else (prev_state, prev_a_post, prev_bias, seed, p,
                                            prev_stream)
    return dict(post=post, prev=prev)


@torch.library.custom_op("mhc_cg::pre_backward", mutates_args=("g_y_out",))
def pre_backward(g_out: Tensor, g_state: Tensor | None, g_post: Tensor | None, x: Tensor,
                 weight: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor, bias: Tensor,
                 norm_weight: Tensor | None, state: Tensor, n: int, iterations: int, eps: float,
                 use_triton: bool, h_res_transposed: bool = False, y: Tensor | None = None,
                 seed: Tensor | None = None, p: float = 0.0, stream: int = 0,
                 prev_state: Tensor | None = None, prev_a_post: Tensor | None = None,
                 prev_bias: Tensor | None = None, prev_stream: int = 0,
                 g_y_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(g_x, g_weight, g_params [m+3], g_norm_weight)``, ``g_x`` with the post's residual path
    ``H_res^T g_post`` (``H_res g_post`` transposed); the mapping weight's gradient from the
    same reads of x; the parameters' gradients summed over the tokens in a fixed order.
    ``y`` given: the post's reductions too (dropout ``seed``, ``p``, ``stream``), its shares in
    ``g_params``; ``prev_state`` given: the F output's gradient of the post that wrote x (its
    ``prev_*``, the same seed and rate) into ``g_y_out``."""
    g_x, g_weight, shares, g_w = _impl(use_triton).pre_backward(
        g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight, state, n,
        iterations, eps, h_res_transposed=h_res_transposed, g_y_out=g_y_out,
        **_around(y, seed, p, stream, prev_state, prev_a_post, prev_bias, prev_stream))
    return g_x, g_weight, *_summed(shares, g_w, bias, x, norm_weight)


@pre_backward.register_fake
def _(g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight, state, n,
      iterations, eps, use_triton, h_res_transposed=False, y=None, seed=None, p=0.0, stream=0,
      prev_state=None, prev_a_post=None, prev_bias=None, prev_stream=0, g_y_out=None):
    return (x.new_empty(x.shape), *_pre_backward_fakes(x, weight, bias, norm_weight))


@torch.library.custom_op("mhc_cg::pre_backward_into", mutates_args=("g_post", "g_y_out"))
def pre_backward_into(g_out: Tensor, g_state: Tensor | None, g_post: Tensor, x: Tensor,
                      weight: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor, bias: Tensor,
                      norm_weight: Tensor | None, state: Tensor, n: int, iterations: int,
                      eps: float, use_triton: bool, h_res_transposed: bool = False,
                      y: Tensor | None = None, seed: Tensor | None = None, p: float = 0.0,
                      stream: int = 0, prev_state: Tensor | None = None,
                      prev_a_post: Tensor | None = None, prev_bias: Tensor | None = None,
                      prev_stream: int = 0,
                      g_y_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`pre_backward` writing x's gradient over ``g_post``, which it reads first: the
    stream's gradient keeps one buffer down a chain of sublayers."""
    _, g_weight, shares, g_w = _impl(use_triton).pre_backward(
        g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight, state, n,
        iterations, eps, g_post, h_res_transposed=h_res_transposed, g_y_out=g_y_out,
        **_around(y, seed, p, stream, prev_state, prev_a_post, prev_bias, prev_stream))
    return g_weight, *_summed(shares, g_w, bias, x, norm_weight)


@pre_backward_into.register_fake
def _(g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight, state, n,
      iterations, eps, use_triton, h_res_transposed=False, y=None, seed=None, p=0.0, stream=0,
      prev_state=None, prev_a_post=None, prev_bias=None, prev_stream=0, g_y_out=None):
    return _pre_backward_fakes(x, weight, bias, norm_weight)


@torch.library.custom_op("mhc_cg::pre_from_state", mutates_args=())
def pre_from_state(x: Tensor, state: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
                   bias: Tensor, norm_weight: Tensor | None, n: int, use_triton: bool) -> Tensor:
    """F's input [T, C] from ``x`` and the state the previous post computed
    (:func:`post_state`): the pre's second pass alone, one read of x."""
    return _impl(use_triton).fn_input(x, state, a_pre, a_post, a_res, bias, norm_weight, n)


@pre_from_state.register_fake
def _(x, state, a_pre, a_post, a_res, bias, norm_weight, n, use_triton):
    return x.new_empty(x.shape[0], x.shape[1] // n)


@torch.library.custom_op("mhc_cg::pre_from_state_into", mutates_args=("fn_input_out",))
def pre_from_state_into(x: Tensor, state: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
                        bias: Tensor, norm_weight: Tensor | None, n: int, use_triton: bool,
                        fn_input_out: Tensor) -> None:
    """:func:`pre_from_state` writing into the buffer it is given."""
    _impl(use_triton).fn_input(x, state, a_pre, a_post, a_res, bias, norm_weight, n, fn_input_out)


@pre_from_state_into.register_fake
def _(x, state, a_pre, a_post, a_res, bias, norm_weight, n, use_triton, fn_input_out):
    return None


def _summed(shares: Tensor, g_w: Tensor, bias: Tensor, x: Tensor,
            norm_weight: Tensor | None) -> tuple[Tensor, Tensor]:
    g_norm = g_w.sum(0).to(x.dtype) if norm_weight is not None else x.new_empty(0)
    return shares.sum(0).to(bias.dtype), g_norm


def _pre_backward_fakes(x, weight, bias, norm_weight):
    c = norm_weight.shape[0] if norm_weight is not None else 0
    return (weight.new_empty(weight.shape), bias.new_empty(bias.shape[0] + 3), x.new_empty(c))


# ---- post: its mappings once per token, then H_res x + dropout(H_post y) in one pass ------------

@torch.library.custom_op("mhc_cg::post_maps", mutates_args=())
def post_maps(states: Tensor, bias: Tensor, a_post: Tensor, a_res: Tensor, width: int, n: int,
              iterations: int, use_triton: bool) -> Tensor:
    """``[H_post / 2 | H_res]`` per post and token (:func:`post_maps_shape`) from ``states
    [P, T, m+2]``, ``bias [P, m]``, ``a_post``/``a_res [P]`` (``width`` = nC): Sinkhorn once
    per token, for the post's and the recompute's feature blocks to read the same bits."""
    return _impl(use_triton).post_maps(states, bias, a_post, a_res, width, n, iterations)


@post_maps.register_fake
def _(states, bias, a_post, a_res, width, n, iterations, use_triton):
    return states.new_empty(post_maps_shape(states.shape[1], n, states.shape[0]))


@torch.library.custom_op("mhc_cg::post", mutates_args=())
def post(x: Tensor, state: Tensor, maps: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
         bias: Tensor, y: Tensor, seed: Tensor | None, p: float, stream: int, n: int,
         iterations: int, use_triton: bool, h_res_transposed: bool = False) -> Tensor:
    """``H_res x + dropout(H_post y)`` [T, nC], the mappings from ``maps [T, n + n*n]``
    (:func:`post_maps`); the mask is ``counter_hash(seed, stream, index)``."""
    return _impl(use_triton).post(x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n,
                                  iterations, h_res_transposed=h_res_transposed, maps=maps)


@post.register_fake
def _(x, state, maps, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations, use_triton,
      h_res_transposed=False):
    return x.new_empty(x.shape)


@torch.library.custom_op("mhc_cg::post_into", mutates_args=("out",))
def post_into(x: Tensor, state: Tensor, maps: Tensor, a_pre: Tensor, a_post: Tensor,
              a_res: Tensor, bias: Tensor, y: Tensor, seed: Tensor | None, p: float, stream: int,
              n: int, iterations: int, use_triton: bool, out: Tensor,
              h_res_transposed: bool = False) -> None:
    """:func:`post` writing into the buffer it is given (the next sublayer's input slot)."""
    _impl(use_triton).post(x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations,
                           out, h_res_transposed=h_res_transposed, maps=maps)


@post_into.register_fake
def _(x, state, maps, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations, use_triton,
      out, h_res_transposed=False):
    return None


@torch.library.custom_op("mhc_cg::post_state", mutates_args=())
def post_state(x: Tensor, maps: Tensor, y: Tensor, seed: Tensor | None, p: float, stream: int,
               n: int, weight: Tensor, a_pre: Tensor, bias: Tensor, norm: bool, eps: float,
               use_triton: bool, h_res_transposed: bool = False) -> tuple[Tensor, Tensor]:
    """``(H_res x + dropout(H_post y) [T, nC], its state [T, m+2])``: the post and, from the
    tiles it writes, the state the next pre (``weight``, ``a_pre``, ``bias``, ``norm``, ``eps``)
    needs, so that pre reads its input once (:func:`pre_from_state`)."""
    return _impl(use_triton).post_state(x, maps, y, seed, p, stream, n, weight, a_pre, bias, norm,
                                        eps, h_res_transposed=h_res_transposed)


@post_state.register_fake
def _(x, maps, y, seed, p, stream, n, weight, a_pre, bias, norm, eps, use_triton,
      h_res_transposed=False):
    return (x.new_empty(x.shape), x.new_empty(x.shape[0], state_width(weight.shape[0]),
                                              dtype=state_dtype(x.dtype)))


@torch.library.custom_op("mhc_cg::post_state_into", mutates_args=("out", "state_out"))
def post_state_into(x: Tensor, maps: Tensor, y: Tensor, seed: Tensor | None, p: float,
                    stream: int, n: int, weight: Tensor, a_pre: Tensor, bias: Tensor, norm: bool,
                    eps: float, use_triton: bool, out: Tensor, state_out: Tensor,
                    h_res_transposed: bool = False) -> None:
    """:func:`post_state` writing into the buffers it is given (the next sublayer's input slot
    and its state in the persistent set)."""
    _impl(use_triton).post_state(x, maps, y, seed, p, stream, n, weight, a_pre, bias, norm, eps,
                                 out, state_out, h_res_transposed=h_res_transposed)


@post_state_into.register_fake
def _(x, maps, y, seed, p, stream, n, weight, a_pre, bias, norm, eps, use_triton, out, state_out,
      h_res_transposed=False):
    return None


@torch.library.custom_op("mhc_cg::post_backward", mutates_args=())
def post_backward(g: Tensor, x: Tensor, state: Tensor, a_pre: Tensor, a_post: Tensor,
                  a_res: Tensor, bias: Tensor, y: Tensor, seed: Tensor | None, p: float,
                  stream: int, n: int, iterations: int, use_triton: bool,
                  h_res_transposed: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(g_state, g_params [m+3], g_y)``; the mask regenerated from ``seed``. x's gradient is
    :func:`pre_backward`'s (``g_post``)."""
    g_state, shares, g_y = _impl(use_triton).post_backward(
        g, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations,
        h_res_transposed=h_res_transposed)
    return g_state, shares.sum(0).to(bias.dtype), g_y


@post_backward.register_fake
def _(g, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations, use_triton,
      h_res_transposed=False):
    return state.new_empty(state.shape), bias.new_empty(bias.shape[0] + 3), y.new_empty(y.shape)


@torch.library.custom_op("mhc_cg::post_grad_y", mutates_args=())
def post_grad_y(g: Tensor, state: Tensor, a_post: Tensor, bias: Tensor, seed: Tensor | None,
                p: float, stream: int, n: int, y_dtype: torch.dtype, use_triton: bool) -> Tensor:
    """F's output's gradient through the post, from its output's gradient alone: the post's
    backward where the pre's backward took its reductions and no next pre computed it."""
    return _impl(use_triton).post_grad_y(g, state, a_post, bias, seed, p, stream, n, y_dtype)


@post_grad_y.register_fake
def _(g, state, a_post, bias, seed, p, stream, n, y_dtype, use_triton):
    return g.new_empty(g.shape[0], g.shape[1] // n, dtype=y_dtype)


# ---- a block's recompute, in one pass ----------------------------------------------------------

@torch.library.custom_op("mhc_cg::recompute", mutates_args=("x_out", "fn_input_out"))
def recompute(x0: Tensor, ys: Tensor, states: Tensor, maps: Tensor, params: Tensor,
              norm_weights: Tensor | None, seed: Tensor | None, p: float, streams: list[int],
              n: int, iterations: int, eps: float, use_triton: bool, x_out: Tensor,
              fn_input_out: Tensor, h_res_transposed: bool = False) -> None:
    """A block's sublayer inputs (``x_out [S-1, T, nC]``) and F inputs (``fn_input_out [S, T, C]``)
    from its input, F's outputs, the states and the posts' ``maps [S-1, T, n + n*n]``
    (:func:`post_maps`); see ``reference.recompute``."""
    _impl(use_triton).recompute(x0, ys, states, params, norm_weights, seed, p, streams, n,
                                iterations, eps, x_out, fn_input_out,
                                h_res_transposed=h_res_transposed, maps=maps)


@recompute.register_fake
def _(x0, ys, states, maps, params, norm_weights, seed, p, streams, n, iterations, eps, use_triton,
      x_out, fn_input_out, h_res_transposed=False):
    return None


# ---- RMSNorm ----------------------------------------------------------------------------------

@torch.library.custom_op("mhc_cg::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, use_triton: bool) -> Tensor:
    return _impl(use_triton).rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps, use_triton):
    return x.new_empty(x.shape)


@torch.library.custom_op("mhc_cg::rms_norm_backward", mutates_args=())
def rms_norm_backward(g: Tensor, x: Tensor, weight: Tensor, eps: float,
                      use_triton: bool) -> tuple[Tensor, Tensor]:
    return _impl(use_triton).rms_norm_backward(g, x, weight, eps)


@rms_norm_backward.register_fake
def _(g, x, weight, eps, use_triton):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output):
    x, weight, eps, use_triton = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (eps, use_triton)


def _rms_grad(ctx, g):
    x, weight = ctx.saved_tensors
    g_x, g_w = rms_norm_backward(g, x, weight, *ctx.args)
    return g_x, g_w, None, None


rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup)


# ---- the loss ------------------------------------------------------------------------------------

@torch.library.custom_op("mhc_cg::cross_entropy", mutates_args=())
def cross_entropy(logits: Tensor, targets: Tensor, use_triton: bool,
                  grad_over_logits: bool = False) -> tuple[Tensor, Tensor]:
    """``(loss [T], lse [T])`` of ``logits [T, V]`` and ``targets [T]``, in the compute dtype.
    ``grad_over_logits``: the backward writes the logits' gradient over the logits
    (:func:`cross_entropy_backward_`)."""
    return _impl(use_triton).cross_entropy(logits, targets)


@cross_entropy.register_fake
def _(logits, targets, use_triton, grad_over_logits=False):
    acc = state_dtype(logits.dtype)
    return logits.new_empty(logits.shape[0], dtype=acc), logits.new_empty(logits.shape[0], dtype=acc)


@torch.library.custom_op("mhc_cg::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(g: Tensor, logits: Tensor, targets: Tensor, lse: Tensor,
                           use_triton: bool) -> Tensor:
    return _impl(use_triton).cross_entropy_backward(g, logits, targets, lse)


@cross_entropy_backward.register_fake
def _(g, logits, targets, lse, use_triton):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("mhc_cg::cross_entropy_backward_", mutates_args=("logits",))
def cross_entropy_backward_(g: Tensor, logits: Tensor, targets: Tensor, lse: Tensor,
                            use_triton: bool) -> None:
    """:func:`cross_entropy_backward` writing the gradient over the logits, row by row (each row
    is read before it is written): no second ``[T, V]`` tensor at the step's peak."""
    _impl(use_triton).cross_entropy_backward(g, logits, targets, lse, logits)


@cross_entropy_backward_.register_fake
def _(g, logits, targets, lse, use_triton):
    return None


def _ce_setup(ctx, inputs, output):
    logits, targets, use_triton, *over = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.use_triton, ctx.over = use_triton, bool(over and over[0])
    ctx.mark_non_differentiable(output[1])


def _ce_grad(ctx, g_loss, g_lse):
    logits, targets, lse = ctx.saved_tensors
    if not ctx.over:
        return cross_entropy_backward(g_loss, logits, targets, lse, ctx.use_triton), None, None, None
    cross_entropy_backward_(g_loss, logits, targets, lse, ctx.use_triton)
    return logits, None, None, None


cross_entropy.register_autograd(_ce_grad, setup_context=_ce_setup)
