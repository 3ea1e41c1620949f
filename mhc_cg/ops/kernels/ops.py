"""The fused mHC ops as ``torch.library`` custom ops (namespace ``mhc_cg``).

Each op is one opaque node for autograd, ``torch.compile``, ``TorchDispatchMode`` recorders (the
graph tape sees ``torch.ops.mhc_cg.<name>.default``) and the ``meta`` device (fake
implementations). Forward and backward are one op each; the boolean ``use_triton`` argument picks
the Triton kernels (``mhc_cg.ops.kernels.triton_kernels``) or the torch reference
(``mhc_cg.ops.kernels.reference``). Every op takes token-major 2-D tensors; ``mhc_cg.ops.kernels``
flattens and restores the ``[s, b, ...]`` layout around them with views.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhc_cg.ops.kernels import reference


def _impl(use_triton: bool):
    if use_triton:
        from mhc_cg.ops.kernels.dispatch import triton_kernels

        return triton_kernels()
    return reference


# ---- mappings ---------------------------------------------------------------------------------

@torch.library.custom_op("mhc_cg::mappings", mutates_args=())
def mappings(proj: Tensor, xnorm: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
             bias: Tensor, n: int, iterations: int, sqrt_d: float,
             use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _impl(use_triton).mappings(proj, xnorm, a_pre, a_post, a_res, bias, n, iterations, sqrt_d)


@mappings.register_fake
def _(proj, xnorm, a_pre, a_post, a_res, bias, n, iterations, sqrt_d, use_triton):
    t = proj.shape[0]
    return proj.new_empty(t, n), proj.new_empty(t, n), proj.new_empty(t, n, n)


@torch.library.custom_op("mhc_cg::mappings_backward", mutates_args=())
def mappings_backward(g_pre: Tensor, g_post: Tensor, g_res: Tensor, proj: Tensor, xnorm: Tensor,
                      a_pre: Tensor, a_post: Tensor, a_res: Tensor, bias: Tensor, n: int,
                      iterations: int, sqrt_d: float,
                      use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(g_proj, g_xnorm, g_params)``; ``g_params = [g_bias (m) | g_alpha_pre, _post, _res]``."""
    g_proj, g_xnorm, partial = _impl(use_triton).mappings_partials(
        g_pre, g_post, g_res, proj, xnorm, a_pre, a_post, a_res, bias, n, iterations, sqrt_d)
    return g_proj, g_xnorm, partial.sum(0).to(bias.dtype)  # a fixed-order sum: deterministic


@mappings_backward.register_fake
def _(g_pre, g_post, g_res, proj, xnorm, a_pre, a_post, a_res, bias, n, iterations, sqrt_d,
      use_triton):
    return proj.new_empty(proj.shape), xnorm.new_empty(xnorm.shape), bias.new_empty(bias.shape[0] + 3)


def _mappings_setup(ctx, inputs, output):
    proj, xnorm, a_pre, a_post, a_res, bias, n, iterations, sqrt_d, use_triton = inputs
    ctx.save_for_backward(proj, xnorm, a_pre, a_post, a_res, bias)
    ctx.args = (n, iterations, sqrt_d, use_triton)


def _mappings_grad(ctx, g_pre, g_post, g_res):
    proj, xnorm, a_pre, a_post, a_res, bias = ctx.saved_tensors
    n, iterations, sqrt_d, use_triton = ctx.args
    t = proj.shape[0]
    g_pre = proj.new_zeros(t, n) if g_pre is None else g_pre
    g_post = proj.new_zeros(t, n) if g_post is None else g_post
    g_res = proj.new_zeros(t, n, n) if g_res is None else g_res
    g_proj, g_xnorm, g_params = mappings_backward(g_pre, g_post, g_res, proj, xnorm, a_pre, a_post,
                                                  a_res, bias, n, iterations, sqrt_d, use_triton)
    m = bias.shape[0]
    return (g_proj, g_xnorm, g_params[m:m + 1], g_params[m + 1:m + 2], g_params[m + 2:m + 3],
            g_params[:m], None, None, None, None)


mappings.register_autograd(_mappings_grad, setup_context=_mappings_setup)


# ---- aggregate --------------------------------------------------------------------------------

@torch.library.custom_op("mhc_cg::aggregate", mutates_args=())
def aggregate(x: Tensor, h_pre: Tensor, use_triton: bool) -> Tensor:
    return _impl(use_triton).aggregate(x, h_pre, h_pre.shape[1])


@aggregate.register_fake
def _(x, h_pre, use_triton):
    return x.new_empty(x.shape[0], x.shape[1] // h_pre.shape[1])


@torch.library.custom_op("mhc_cg::aggregate_backward", mutates_args=())
def aggregate_backward(g: Tensor, x: Tensor, h_pre: Tensor, use_triton: bool) -> tuple[Tensor, Tensor]:
    return _impl(use_triton).aggregate_backward(g, x, h_pre, h_pre.shape[1])


@aggregate_backward.register_fake
def _(g, x, h_pre, use_triton):
    return x.new_empty(x.shape), h_pre.new_empty(h_pre.shape)


def _aggregate_setup(ctx, inputs, output):
    x, h_pre, use_triton = inputs
    ctx.save_for_backward(x, h_pre)
    ctx.use_triton = use_triton


def _aggregate_grad(ctx, g):
    x, h_pre = ctx.saved_tensors
    g_x, g_h = aggregate_backward(g, x, h_pre, ctx.use_triton)
    return g_x, g_h, None


aggregate.register_autograd(_aggregate_grad, setup_context=_aggregate_setup)


# ---- h_res ------------------------------------------------------------------------------------

@torch.library.custom_op("mhc_cg::h_res_apply", mutates_args=())
def h_res_apply(h_res: Tensor, x: Tensor, use_triton: bool) -> Tensor:
    return _impl(use_triton).h_res_apply(h_res, x)


@h_res_apply.register_fake
def _(h_res, x, use_triton):
    return x.new_empty(x.shape)


@torch.library.custom_op("mhc_cg::h_res_apply_backward", mutates_args=())
def h_res_apply_backward(g: Tensor, h_res: Tensor, x: Tensor,
                         use_triton: bool) -> tuple[Tensor, Tensor]:
    return _impl(use_triton).h_res_apply_backward(g, h_res, x)


@h_res_apply_backward.register_fake
def _(g, h_res, x, use_triton):
    return h_res.new_empty(h_res.shape), x.new_empty(x.shape)


def _h_res_setup(ctx, inputs, output):
    h_res, x, use_triton = inputs
    ctx.save_for_backward(h_res, x)
    ctx.use_triton = use_triton


def _h_res_grad(ctx, g):
    h_res, x = ctx.saved_tensors
    g_h, g_x = h_res_apply_backward(g, h_res, x, ctx.use_triton)
    return g_h, g_x, None


h_res_apply.register_autograd(_h_res_grad, setup_context=_h_res_setup)


# ---- h_post + bias-dropout-add ----------------------------------------------------------------

@torch.library.custom_op("mhc_cg::post_bda", mutates_args=())
def post_bda(y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None, p: float, stream: int,
             use_triton: bool) -> Tensor:
    """``mixed[i] + dropout(h_post[i] * y)``; the mask is ``counter_hash(seed, stream, index)``."""
    return _impl(use_triton).post_bda(y, h_post, mixed, seed, p, stream)


@post_bda.register_fake
def _(y, h_post, mixed, seed, p, stream, use_triton):
    return mixed.new_empty(mixed.shape)


@torch.library.custom_op("mhc_cg::post_bda_backward", mutates_args=())
def post_bda_backward(g: Tensor, y: Tensor, h_post: Tensor, seed: Tensor | None, p: float,
                      stream: int, use_triton: bool) -> tuple[Tensor, Tensor]:
    """``(g_y, g_h_post)``, the mask regenerated from ``seed`` (none was saved)."""
    return _impl(use_triton).post_bda_backward(g, y, h_post, seed, p, stream)


@post_bda_backward.register_fake
def _(g, y, h_post, seed, p, stream, use_triton):
    return y.new_empty(y.shape), h_post.new_empty(h_post.shape)


def _post_bda_setup(ctx, inputs, output):
    y, h_post, mixed, seed, p, stream, use_triton = inputs
    ctx.save_for_backward(y, h_post, seed)
    ctx.args = (p, stream, use_triton)


def _post_bda_grad(ctx, g):
    y, h_post, seed = ctx.saved_tensors
    p, stream, use_triton = ctx.args
    g_y, g_h = post_bda_backward(g, y, h_post, seed, p, stream, use_triton)
    return g_y, g_h, g, None, None, None, None


post_bda.register_autograd(_post_bda_grad, setup_context=_post_bda_setup)


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
