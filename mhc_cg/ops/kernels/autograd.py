"""The fused sublayer ops as autograd functions: ``pre`` and ``post`` around F.

::

    fn_input, state, x_on = Pre.apply(x, ...)          # x read once; x_on is a view of x
    y = F(fn_input)
    out = Post.apply(x_on, state, ..., y, seed, ...)  # H_res x + dropout(H_post y)

Why ``x_on``: ``x`` then has one consumer, ``Pre``. ``Post``'s gradient for ``x`` arrives at
``Pre``'s backward as the gradient of ``x_on``, and the pre backward kernel adds it in place while
it writes ``x``'s gradient, so the stream's gradient is never summed by separate adds of n-stream
tensors. ``state`` (``[proj | xnorm | rstd]`` per token) is what both ops derive the mappings from, so
neither H_pre, H_post nor H_res is ever materialised or kept.

Buffers: given ``fn_input_out`` / ``state_out`` / ``out`` (a :class:`Target`), an op writes its
result there (``*_into`` ops) instead of allocating it: the static runtime's arena slots and
persistent set. The function then returns a fresh view of the buffer's *reader* alias, whose
version counter the writes (through the *writer* alias) never move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mhc_cg.ops.kernels import ops
from mhc_cg.ops.kernels.reference import state_dtype, state_width


@dataclass(frozen=True)
class Target:
    """A buffer an op writes into: ``writer`` receives the write, ``reader`` is what is returned
    (the same memory; for arena slots two aliases with their own version counters)."""

    writer: Tensor
    reader: Tensor

    @classmethod
    def of(cls, t: Tensor) -> "Target":
        return cls(t, t)

    def view(self) -> Tensor:
        r = self.reader
        return r.as_strided(r.size(), r.stride(), r.storage_offset())


@dataclass(frozen=True)
class PreConfig:
    n: int
    iterations: int
    eps: float
    use_triton: bool


class Pre(torch.autograd.Function):
    """``(x, mapping weight, alphas, bias, norm weight) -> (F's input, state, x_on)``."""

    @staticmethod
    def forward(ctx, x, weight, a_pre, a_post, a_res, bias, norm_weight, cfg: PreConfig,
                fn_input_out: Target | None, state_out: Target | None):
        args = (x, weight, a_pre, a_post, a_res, bias, norm_weight, cfg.n, cfg.iterations,
                cfg.eps, cfg.use_triton)
        if fn_input_out is None:
            fn_input, state = ops.pre(*args)
        else:
            if state_out is None:  # a state of its own: where it lives is no buffer's concern
                state_out = Target.of(x.new_empty(x.shape[0], state_width(weight.shape[0]),
                                                  dtype=state_dtype(x.dtype)))
            ops.pre_into(*args, fn_input_out.writer, state_out.writer)
            fn_input, state = fn_input_out.view(), state_out.view()
        ctx.save_for_backward(x, weight, a_pre, a_post, a_res, bias, norm_weight, state)
        ctx.cfg = cfg
        return fn_input, state, x.view_as(x)

    @staticmethod
    def backward(ctx, g_fn_input, g_state, g_x_on):
        x, weight, a_pre, a_post, a_res, bias, norm_weight, state = ctx.saved_tensors
        cfg = ctx.cfg
        if g_fn_input is None:
            g_fn_input = torch.zeros(x.shape[0], x.shape[1] // cfg.n, dtype=x.dtype,
                                     device=x.device)
        if g_state is None:
            g_state = torch.zeros_like(state)
        g_x, g_proj, g_params, g_w = ops.pre_backward(
            g_fn_input, g_state, g_x_on, x, weight, a_pre, a_post, a_res, bias, norm_weight,
            state, cfg.n, cfg.iterations, cfg.eps, cfg.use_triton)
        g_weight = g_proj.to(x.dtype).t() @ x  # the projection's weight: a GEMM, deterministic
        return (g_x, g_weight.to(weight.dtype), *_alphas_and_bias(g_params, bias),
                g_w if norm_weight is not None else None, None, None, None)


@dataclass(frozen=True)
class PostConfig:
    p: float
    stream: int
    n: int
    iterations: int
    use_triton: bool


class Post(torch.autograd.Function):
    """``(x_on, state, alphas, bias, y, seed) -> H_res x + dropout(H_post y)``."""

    @staticmethod
    def forward(ctx, x, state, a_pre, a_post, a_res, bias, y, seed, cfg: PostConfig,
                out: Target | None):
        args = (x, state, a_pre, a_post, a_res, bias, y, seed, cfg.p, cfg.stream, cfg.n,
                cfg.iterations, cfg.use_triton)
        if out is None:
            result = ops.post(*args)
        else:
            ops.post_into(*args, out.writer)
            result = out.view()
        ctx.save_for_backward(x, state, a_pre, a_post, a_res, bias, y, seed)
        ctx.cfg = cfg
        return result

    @staticmethod
    def backward(ctx, g):
        x, state, a_pre, a_post, a_res, bias, y, seed = ctx.saved_tensors
        cfg = ctx.cfg
        g_x, g_state, g_params, g_y = ops.post_backward(
            g, x, state, a_pre, a_post, a_res, bias, y, seed, cfg.p, cfg.stream, cfg.n,
            cfg.iterations, cfg.use_triton)
        return (g_x, g_state, *_alphas_and_bias(g_params, bias), g_y, None, None, None)


def _alphas_and_bias(g_params: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``g_params = [g_bias (m) | g_a_pre, g_a_post, g_a_res]`` -> the parameters' order."""
    m = bias.shape[0]
    return g_params[m:m + 1], g_params[m + 1:m + 2], g_params[m + 2:m + 3], g_params[:m]
