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

import torch
from torch import Tensor

from mhc_cg.ops.kernels import reference
from mhc_cg.ops.kernels.reference import state_dtype, state_width
from mhc_cg.ops.kernels.tiling import post_maps_shape


def _impl(use_triton: bool, arithmetic: str = "main"):
    if arithmetic not in reference.ARITHMETICS:
        raise ValueError(f"mhc_cg kernels: arithmetic must be one of {list(reference.ARITHMETICS)}, "
                         f"got {arithmetic!r}")
    if use_triton:
        from mhc_cg.ops.kernels.dispatch import triton_kernels

        return triton_kernels()
    return reference


# ---- pre: mappings, aggregate and norm, from one read of x ----------------------------------------

@torch.library.custom_op("mhc_cg::pre", mutates_args=())
def pre(x: Tensor, weight: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor, bias: Tensor,
        norm_weight: Tensor | None, n: int, iterations: int, eps: float,
        use_triton: bool, arithmetic: str = "main") -> tuple[Tensor, Tensor]:
    """``(F's input [T, C], state [T, m+2])``; see ``reference.pre``."""
    return _impl(use_triton, arithmetic).pre(x, weight, a_pre, a_post, a_res, bias, norm_weight,
                                             n, iterations, eps, arithmetic=arithmetic)


@pre.register_fake
def _(x, weight, a_pre, a_post, a_res, bias, norm_weight, n, iterations, eps, use_triton,
      arithmetic="main"):
    return (x.new_empty(x.shape[0], x.shape[1] // n),
            x.new_empty(x.shape[0], state_width(weight.shape[0]), dtype=state_dtype(x.dtype)))


@torch.library.custom_op("mhc_cg::pre_into", mutates_args=("fn_input_out", "state_out"))
def pre_into(x: Tensor, weight: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
             bias: Tensor, norm_weight: Tensor | None, n: int, iterations: int, eps: float,
             use_triton: bool, fn_input_out: Tensor, state_out: Tensor,
             arithmetic: str = "main") -> None:
    """:func:`pre` writing into buffers it is given (an arena slot, the persistent set)."""
    _impl(use_triton, arithmetic).pre(x, weight, a_pre, a_post, a_res, bias, norm_weight, n,
                                      iterations, eps, fn_input_out, state_out,
                                      arithmetic=arithmetic)


@pre_into.register_fake
def _(x, weight, a_pre, a_post, a_res, bias, norm_weight, n, iterations, eps, use_triton,
      fn_input_out, state_out, arithmetic="main"):
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
                 g_y_out: Tensor | None = None,
                 arithmetic: str = "main") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(g_x, g_weight, g_params [m+3], g_norm_weight)``, ``g_x`` with the post's residual path
    ``H_res^T g_post`` (``H_res g_post`` transposed); the mapping weight's gradient from the
    same reads of x; the parameters' gradients summed over the tokens in a fixed order.
    ``y`` given: the post's reductions too (dropout ``seed``, ``p``, ``stream``), its shares in
    ``g_params``; ``prev_state`` given: the F output's gradient of the post that wrote x (its
    ``prev_*``, the same seed and rate) into ``g_y_out``."""
    g_x, g_weight, shares, g_w = _impl(use_triton, arithmetic).pre_backward(
        g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight, state, n,
        iterations, eps, h_res_transposed=h_res_transposed, g_y_out=g_y_out,
        arithmetic=arithmetic,
        **_around(y, seed, p, stream, prev_state, prev_a_post, prev_bias, prev_stream))
    return g_x, g_weight, *_summed(shares, g_w, bias, x, norm_weight)


@pre_backward.register_fake
def _(g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight, state, n,
      iterations, eps, use_triton, h_res_transposed=False, y=None, seed=None, p=0.0, stream=0,
      prev_state=None, prev_a_post=None, prev_bias=None, prev_stream=0, g_y_out=None,
      arithmetic="main"):
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
                      g_y_out: Tensor | None = None,
                      arithmetic: str = "main") -> tuple[Tensor, Tensor, Tensor]:
    """:func:`pre_backward` writing x's gradient over ``g_post``, which it reads first: the
    stream's gradient keeps one buffer down a chain of sublayers."""
    _, g_weight, shares, g_w = _impl(use_triton, arithmetic).pre_backward(
        g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight, state, n,
        iterations, eps, g_post, h_res_transposed=h_res_transposed, g_y_out=g_y_out,
        arithmetic=arithmetic,
        **_around(y, seed, p, stream, prev_state, prev_a_post, prev_bias, prev_stream))
    return g_weight, *_summed(shares, g_w, bias, x, norm_weight)


@pre_backward_into.register_fake
def _(g_out, g_state, g_post, x, weight, a_pre, a_post, a_res, bias, norm_weight, state, n,
      iterations, eps, use_triton, h_res_transposed=False, y=None, seed=None, p=0.0, stream=0,
      prev_state=None, prev_a_post=None, prev_bias=None, prev_stream=0, g_y_out=None,
      arithmetic="main"):
    return _pre_backward_fakes(x, weight, bias, norm_weight)


@torch.library.custom_op("mhc_cg::pre_from_state", mutates_args=())
def pre_from_state(x: Tensor, state: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
                   bias: Tensor, norm_weight: Tensor | None, n: int, use_triton: bool,
                   arithmetic: str = "main") -> Tensor:
    """F's input [T, C] from ``x`` and the state the previous post computed
    (:func:`post_state`): the pre's second pass alone, one read of x."""
    return _impl(use_triton, arithmetic).fn_input(x, state, a_pre, a_post, a_res, bias,
                                                  norm_weight, n, arithmetic=arithmetic)


@pre_from_state.register_fake
def _(x, state, a_pre, a_post, a_res, bias, norm_weight, n, use_triton, arithmetic="main"):
    return x.new_empty(x.shape[0], x.shape[1] // n)


@torch.library.custom_op("mhc_cg::pre_from_state_into", mutates_args=("fn_input_out",))
def pre_from_state_into(x: Tensor, state: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
                        bias: Tensor, norm_weight: Tensor | None, n: int, use_triton: bool,
                        fn_input_out: Tensor, arithmetic: str = "main") -> None:
    """:func:`pre_from_state` writing into the buffer it is given."""
    _impl(use_triton, arithmetic).fn_input(x, state, a_pre, a_post, a_res, bias, norm_weight, n,
                                           fn_input_out, arithmetic=arithmetic)


@pre_from_state_into.register_fake
def _(x, state, a_pre, a_post, a_res, bias, norm_weight, n, use_triton, fn_input_out,
      arithmetic="main"):
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
              iterations: int, use_triton: bool, arithmetic: str = "main") -> Tensor:
    """``[H_post / 2 | H_res]`` per post and token (:func:`post_maps_shape`) from ``states
    [P, T, m+2]``, ``bias [P, m]``, ``a_post``/``a_res [P]`` (``width`` = nC): Sinkhorn once
    per token, for the post's and the recompute's feature blocks to read the same bits."""
    return _impl(use_triton, arithmetic).post_maps(states, bias, a_post, a_res, width, n,
                                                   iterations, arithmetic=arithmetic)


@post_maps.register_fake
def _(states, bias, a_post, a_res, width, n, iterations, use_triton, arithmetic="main"):
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
               use_triton: bool, h_res_transposed: bool = False,
               arithmetic: str = "main") -> tuple[Tensor, Tensor]:
    """``(H_res x + dropout(H_post y) [T, nC], its state [T, m+2])``: the post and, from the
    tiles it writes, the state the next pre (``weight``, ``a_pre``, ``bias``, ``norm``, ``eps``)
    needs, so that pre reads its input once (:func:`pre_from_state`)."""
    return _impl(use_triton, arithmetic).post_state(x, maps, y, seed, p, stream, n, weight, a_pre,
                                                    bias, norm, eps,
                                                    h_res_transposed=h_res_transposed,
                                                    arithmetic=arithmetic)


@post_state.register_fake
def _(x, maps, y, seed, p, stream, n, weight, a_pre, bias, norm, eps, use_triton,
      h_res_transposed=False, arithmetic="main"):
    return (x.new_empty(x.shape), x.new_empty(x.shape[0], state_width(weight.shape[0]),
                                              dtype=state_dtype(x.dtype)))


@torch.library.custom_op("mhc_cg::post_state_into", mutates_args=("out", "state_out"))
def post_state_into(x: Tensor, maps: Tensor, y: Tensor, seed: Tensor | None, p: float,
                    stream: int, n: int, weight: Tensor, a_pre: Tensor, bias: Tensor, norm: bool,
                    eps: float, use_triton: bool, out: Tensor, state_out: Tensor,
                    h_res_transposed: bool = False, arithmetic: str = "main") -> None:
    """:func:`post_state` writing into the buffers it is given (the next sublayer's input slot
    and its state in the persistent set)."""
    _impl(use_triton, arithmetic).post_state(x, maps, y, seed, p, stream, n, weight, a_pre, bias,
                                             norm, eps, out, state_out,
                                             h_res_transposed=h_res_transposed,
                                             arithmetic=arithmetic)


@post_state_into.register_fake
def _(x, maps, y, seed, p, stream, n, weight, a_pre, bias, norm, eps, use_triton, out, state_out,
      h_res_transposed=False, arithmetic="main"):
    return None


@torch.library.custom_op("mhc_cg::post_backward", mutates_args=())
def post_backward(g: Tensor, x: Tensor, state: Tensor, a_pre: Tensor, a_post: Tensor,
                  a_res: Tensor, bias: Tensor, y: Tensor, seed: Tensor | None, p: float,
                  stream: int, n: int, iterations: int, use_triton: bool,
                  h_res_transposed: bool = False,
                  arithmetic: str = "main") -> tuple[Tensor, Tensor, Tensor]:
    """``(g_state, g_params [m+3], g_y)``; the mask regenerated from ``seed``. x's gradient is
    :func:`pre_backward`'s (``g_post``)."""
    g_state, shares, g_y = _impl(use_triton, arithmetic).post_backward(
        g, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations,
        h_res_transposed=h_res_transposed, arithmetic=arithmetic)
    return g_state, shares.sum(0).to(bias.dtype), g_y


@post_backward.register_fake
def _(g, x, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations, use_triton,
      h_res_transposed=False, arithmetic="main"):
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
              fn_input_out: Tensor, h_res_transposed: bool = False,
              arithmetic: str = "main") -> None:
    """A block's sublayer inputs (``x_out [S-1, T, nC]``) and F inputs (``fn_input_out [S, T, C]``)
    from its input, F's outputs, the states and the posts' ``maps [S-1, T, n + n*n]``
    (:func:`post_maps`); see ``reference.recompute``."""
    _impl(use_triton, arithmetic).recompute(x0, ys, states, params, norm_weights, seed, p,
                                            streams, n, iterations, eps, x_out, fn_input_out,
                                            h_res_transposed=h_res_transposed, maps=maps,
                                            arithmetic=arithmetic)


@recompute.register_fake
def _(x0, ys, states, maps, params, norm_weights, seed, p, streams, n, iterations, eps, use_triton,
      x_out, fn_input_out, h_res_transposed=False, arithmetic="main"):
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
