"""The fused sublayer ops as autograd functions: ``pre`` and ``post`` around F.

::

    fn_input, state, x_on = Pre.apply(x, ...)          # x_on is a view of x, for the post only
    y = F(fn_input)
    out = Post.apply(x_on, state, ..., y, seed, ...)  # H_res x + dropout(H_post y)

**The stream's gradient is summed in one kernel.** ``x`` has one consumer, ``Pre``; ``Post``
reads it through ``x_on``. The post's backward does not compute its share of x's gradient
(``H_res^T g``, n*C per token): it hands ``g``, its output's gradient, on as ``x_on``'s, and the
pre's backward kernel adds ``H_res^T g`` while it writes x's whole gradient. So the gradient that
autograd delivers for ``x_on`` is the post output's, not ``x_on``'s own: **nothing but the post
may read** ``x_on`` (another consumer's gradient would be summed into it). A post given ``x``
instead of the ``x_on`` of the pre that made its state is refused.

**One gradient buffer down the chain** (Note [the stream's gradient summed once, in place],
docs/design.md, item 13). The pre's backward writes x's gradient over the gradient it receives
for ``x_on`` (``pre_backward_into``) when that gradient is the chain's own: the exact tensor the
next sublayer's pre backward wrote (its :class:`PostLink`, which both backwards hold, says so:
:meth:`PostLink.wrote`), or a graph's static grad-output buffer (the post was told at forward,
``grad_owned``: mhc_cg's ``make_graphed_callables`` passes it at capture; a pre whose ``x_on``
is itself a graph's output is told the same). A chain of sublayers
then keeps one n*C gradient buffer instead of one per sublayer. Anything else (a user's
gradient, an engine's sum) is never written.

``state`` (``[proj | xnorm | rstd]`` per token) is what both ops derive the mappings from, so
neither H_pre, H_post nor H_res is ever materialised or kept.

**A post can compute the next pre's state** (``nxt``, a :class:`NextPre`) from the tiles it
writes, so that pre reads its input once. The state is a non-differentiable output of the post,
handed to the pre on the call path (:class:`Handoff`, or a buffer the runtime names): the pre
takes it as computed and its backward differentiates the state as if it had computed it, the
same bits either way. A handoff holds for the very output tensor it came with, unwritten since.

Note [state in the Function's own ctx]: what one backward tells another lives in an object
both Functions' ctx hold, handed on the call path or found through the autograd graph: a pre and
the post that reads its state share a :class:`SublayerPair` (the post finds the pre's node as its
state's ``grad_fn``); a post and the next pre share the post's :class:`PostLink` (handed with the
state). Nothing is kept in a table keyed by a tensor.

**The post's backward is split between the pres around it.** Its reductions (``g . x_j`` through
H_res, ``g . y`` through H_post, the Sinkhorn's backward) need x, which the pre that made its state
reads anyway: that pre's first pass takes them (:class:`PostTail`), so the post's backward returns
no state or parameter gradient of its own. F's output gradient ``sum_i H_post[i] g[i]`` needs
``g``, which the next pre's backward writes: that pre takes it from the tile it writes
(:class:`PostLink`), so ``g`` is not read again. Where no next pre links (the chain's end, a
graph edge that cannot carry it) the post reads ``g`` once for it (``post_grad_y``).

Buffers: given ``fn_input_out`` / ``state_out`` / ``out`` (a :class:`Target`), an op writes its
result there (``*_into`` ops) instead of allocating it: the static runtime's arena slots and
persistent set. The function then returns a fresh view of the buffer's *reader* alias, whose
version counter the writes (through the *writer* alias) never move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mhc_cg.core.storage import alias, is_buffer
from mhc_cg.ops.kernels import custom_ops as ops
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
        return alias(self.reader)


@dataclass(frozen=True, eq=False)
class NextPre:
    """The pre of the sublayer after a post: what the post needs to compute that pre's state
    from the stream it writes (:func:`ops.post_state`)."""

    weight: Tensor
    a_pre: Tensor
    bias: Tensor
    norm: bool
    eps: float
    arithmetic: str = "main"

    def is_for(self, weight: Tensor, a_pre: Tensor, bias: Tensor, norm: bool, eps: float,
               arithmetic: str = "main") -> bool:
        return (self.weight is weight and self.a_pre is a_pre and self.bias is bias
                and self.norm == norm and self.eps == float(eps)
                and self.arithmetic == arithmetic)


@dataclass(eq=False)
class PostLink:
    """A post whose F output's gradient the next pre's backward computes: that backward writes
    x's gradient, which is the post's output's, and takes ``sum_i H_post[i] mask[i] g[i]`` from
    the tile it writes (the post's formula, the same bits), so the post's backward does not read
    g again. ``g_y_out``: where to write it, a static buffer where the two backwards run in
    different graphs (the runtime names it); else the pre allocates it. The post takes it only
    if the gradient it receives is the very tensor the pre wrote (:meth:`take`), and writes
    over that gradient only then (:meth:`wrote`)."""

    state: Tensor
    a_post: Tensor
    bias: Tensor
    seed: Tensor | None
    p: float
    stream: int
    y_dtype: torch.dtype
    g_y_out: Tensor | None = None
    g_y: Tensor | None = None
    grad: Tensor | None = None
    version: int = -1
    written: Tensor | None = None  # the gradient the next pre's backward wrote, and its version
    written_version: int = -1

    def give(self, g_y: Tensor, grad: Tensor) -> None:
        self.g_y, self.grad, self.version = g_y, grad, grad._version

    def take(self, g: Tensor) -> Tensor | None:
        """The F output's gradient the pre computed from ``g``, if it did; once."""
        g_y, ok = self.g_y, self.grad is g and g._version == self.version
        self.g_y = self.grad = None
        return g_y if ok else None

    def write(self, grad: Tensor) -> None:
        """The next pre's backward wrote ``grad``, the post's output's gradient: no one else
        reads it."""
        self.written, self.written_version = grad, grad._version

    def wrote(self, g: Tensor) -> bool:
        """``g`` is the gradient the next pre's backward wrote, unchanged since; once."""
        ok = self.written is g and g._version == self.written_version
        self.written = None
        return ok


@dataclass(eq=False)
class Handoff:
    """What a post hands the pre that reads its output next, on the call path: that pre's
    ``state`` (computed from the tiles the post wrote) and the post's ``link``. It holds for the
    post's output ``out`` itself while it is unwritten, and for the pre ``nxt`` describes."""

    out: Tensor
    version: int
    state: Tensor
    nxt: NextPre
    link: PostLink | None

    def for_pre(self, x: Tensor, weight: Tensor, a_pre: Tensor, bias: Tensor, norm: bool,
                eps: float, arithmetic: str = "main") -> tuple[Tensor | None, PostLink | None]:
        """``(state, link)`` for the pre of ``weight`` ... reading ``x``, if this handoff is for
        it; else ``(None, None)`` (the pre computes its own state, and the post its F output's
        gradient)."""
        if x is self.out and x._version == self.version \
                and self.nxt.is_for(weight, a_pre, bias, norm, eps, arithmetic):
            return self.state, self.link
        return None, None


@dataclass(eq=False)
class SublayerPair:
    """What a pre's backward and the backward of the post that reads its state tell each other
    (Note [state in the Function's own ctx]): the post defers its reductions to the pre
    (``expects_post``) and hands them over with its gradient (``tail``)."""

    expects_post: bool = False
    tail: "PostTail | None" = None


@dataclass(frozen=True, eq=False)
class PostTail:
    """What the post's backward hands the pre's with its output's gradient ``grad``: what the
    pre's first pass needs for the post's reductions (see the module docstring)."""

    grad: Tensor
    y: Tensor
    seed: Tensor | None
    p: float
    stream: int
    writable: bool = False  # ``grad`` is the chain's own: the pre may write x's gradient over it


@dataclass(frozen=True)
class PreConfig:
    n: int
    iterations: int
    eps: float
    use_triton: bool
    h_res_transposed: bool = False  # the backward adds the post's H_res path to x's gradient
    arithmetic: str = "main"  # main's or dev's mHC (reference.ARITHMETICS)


def _flat(t: Tensor | None, width: int) -> Tensor | None:
    return None if t is None else t.reshape(-1, width)


def _flat_target(target: Target | None, width: int) -> Target | None:
    if target is None:
        return None
    return Target(target.writer.view(-1, width), target.reader.view(-1, width))


class Pre(torch.autograd.Function):
    """``(x [*, nC], mapping weight, alphas, bias, norm weight) -> (F's input [*, C],
    state [*, m+2], x_on)``."""

    @staticmethod
    def forward(ctx, x, weight, a_pre, a_post, a_res, bias, norm_weight, cfg: PreConfig,
                fn_input_out: Target | None, state_out: Target | None, handed: Tensor | None,
                link: PostLink | None, grad_owned: bool):
        lead, width = x.shape[:-1], x.shape[-1]
        c, sw = width // cfg.n, state_width(weight.shape[0])
        xf = x.reshape(-1, width)
        args = (xf, weight, a_pre, a_post, a_res, bias, norm_weight, cfg.n, cfg.iterations,
                cfg.eps, cfg.use_triton)
        if handed is not None:
            fn_input, state = _from_state(xf, handed, args, fn_input_out, state_out, c,
                                          cfg.arithmetic)
        elif fn_input_out is None:
            fn_input, state = ops.pre(*args, cfg.arithmetic)
        else:
            if state_out is None:  # a state of its own: where it lives is no buffer's concern
                state_out = Target.of(x.new_empty(xf.shape[0], sw, dtype=state_dtype(x.dtype)))
            fn_out, st_out = _flat_target(fn_input_out, c), _flat_target(state_out, sw)
            ops.pre_into(*args, fn_out.writer, st_out.writer, cfg.arithmetic)
            fn_input, state = fn_out.view(), st_out.view()
        ctx.save_for_backward(x, weight, a_pre, a_post, a_res, bias, norm_weight, state)
        ctx.cfg = cfg
        ctx.params = (a_pre, a_post, a_res, bias)  # the post that defers to this pre shares them
        ctx.link = link if link is not None and link.state.shape[0] == xf.shape[0] else None
        ctx.pair = SublayerPair()  # shared with the post that reads this state
        ctx.grad_owned = grad_owned  # x_on is a graph's output: its gradient, the graph's buffer
        ctx.set_materialize_grads(False)  # an output nobody used: None, not zeros
        return fn_input.view(*lead, c), state.view(*lead, sw), x.view_as(x)

    @staticmethod
    def backward(ctx, g_fn_input, g_state, g_post):
        x, weight, a_pre, a_post, a_res, bias, norm_weight, state = ctx.saved_tensors
        cfg = ctx.cfg
        width = x.shape[-1]
        xf = x.reshape(-1, width)
        g_fn = (torch.zeros(xf.shape[0], width // cfg.n, dtype=x.dtype, device=x.device)
                if g_fn_input is None else g_fn_input.reshape(-1, width // cfg.n))
        g_st = None if g_state is None else g_state.reshape(state.shape)  # None: no zeros made
        around, writable = _around(ctx, g_post, xf)
        args = (weight, a_pre, a_post, a_res, bias, norm_weight, state, cfg.n, cfg.iterations,
                cfg.eps, cfg.use_triton, cfg.h_res_transposed)
        if writable and _fits(g_post, x):
            g_weight, g_params, g_w = ops.pre_backward_into(g_fn, g_st, g_post.view(-1, width),
                                                            xf, *args, **around,
                                                            arithmetic=cfg.arithmetic)
            g_x = g_post
        else:
            g_x, g_weight, g_params, g_w = ops.pre_backward(g_fn, g_st, _flat(g_post, width), xf,
                                                            *args, **around,
                                                            arithmetic=cfg.arithmetic)
            g_x = g_x.view(x.shape)
        if ctx.link is not None:  # the previous post's output gradient, this backward's own
            if "g_y_out" in around:
                ctx.link.give(around["g_y_out"], g_x)
            ctx.link.write(g_x)
        ctx.link = None
        return (g_x, g_weight, *_alphas_and_bias(g_params, bias),
                g_w if norm_weight is not None else None, None, None, None, None, None, None,
                None)


def _fits(g: Tensor | None, like: Tensor) -> bool:
    """``g`` can take x's gradient in place: its shape, dtype and a dense layout."""
    return (g is not None and g.shape == like.shape and g.dtype == like.dtype
            and g.is_contiguous() and not g.requires_grad)


def _around(ctx, g_post: Tensor | None, xf: Tensor) -> tuple[dict, bool]:
    """The pre backward's halves of the posts around it (:func:`ops.pre_backward`'s ``y`` ...
    ``g_y_out``): its own post's reductions where that post deferred them, the previous post's F
    output gradient where it left a link; and whether ``g_post`` is the chain's own to write
    over (the module docstring)."""
    pair = ctx.pair
    tail, pair.tail = pair.tail, None
    if pair.expects_post and g_post is not None and (tail is None or tail.grad is not g_post):
        raise RuntimeError("mhc_cg pre: x_on's gradient is not the post's alone; nothing but "
                           "the post may read x_on (see mhc_cg.ops.kernels.autograd)")
    around = {}
    if tail is not None:
        around.update(y=tail.y, seed=tail.seed, p=tail.p, stream=tail.stream)
    link = ctx.link
    if link is not None and (tail is None or (tail.seed is link.seed and tail.p == link.p)):
        c = xf.shape[1] // ctx.cfg.n
        g_y_out = xf.new_empty(xf.shape[0], c, dtype=link.y_dtype) if link.g_y_out is None \
            else link.g_y_out.view(-1, c)
        around.update(seed=link.seed, p=link.p, prev_state=link.state, prev_a_post=link.a_post,
                      prev_bias=link.bias, prev_stream=link.stream, g_y_out=g_y_out)
    return around, tail.writable if tail is not None else ctx.grad_owned


def _from_state(xf: Tensor, handed: Tensor, args: tuple, fn_input_out: Target | None,
                state_out: Target | None, c: int, arithmetic: str) -> tuple[Tensor, Tensor]:
    """The pre given the state the previous post computed: F's input from one read of x; the
    state is the one handed over (copied where the pre was asked to keep it)."""
    xf, weight, a_pre, a_post, a_res, bias, norm_weight, n, _, _, use_triton = args
    handed = handed.reshape(-1, handed.shape[-1])
    fn_args = (xf, handed, a_pre, a_post, a_res, bias, norm_weight, n, use_triton)
    if fn_input_out is None:
        fn_input = ops.pre_from_state(*fn_args, arithmetic)
    else:
        fn_out = _flat_target(fn_input_out, c)
        ops.pre_from_state_into(*fn_args, fn_out.writer, arithmetic)
        fn_input = fn_out.view()
    if state_out is None:
        return fn_input, alias(handed)
    st_out = _flat_target(state_out, handed.shape[-1])
    if not is_buffer(st_out.writer, handed):  # the post wrote it there already: no copy
        st_out.writer.copy_(handed)
    return fn_input, st_out.view()


@dataclass(frozen=True)
class PostConfig:
    p: float
    stream: int
    n: int
    iterations: int
    use_triton: bool
    h_res_transposed: bool = False
    arithmetic: str = "main"


class Post(torch.autograd.Function):
    """``(x_on [*, nC], state [*, m+2], alphas, bias, y [*, C], seed) -> H_res x + dropout(H_post y)``."""

    @staticmethod
    def forward(ctx, x, state, a_pre, a_post, a_res, bias, y, seed, cfg: PostConfig,
                out: Target | None, nxt: NextPre | None, state_out: Target | None,
                link: list, grad_owned: bool):
        pre_node = state.grad_fn
        if isinstance(pre_node, Pre._backward_cls) and x.grad_fn is not pre_node:
            raise ValueError("mhc_cg post: x must be the x_on that pre returned with this state, "
                             "not x: the post's backward hands its output's gradient on through it")
        if isinstance(pre_node, Pre._backward_cls) and \
                pre_node.cfg.h_res_transposed != cfg.h_res_transposed:
            raise ValueError("mhc_cg post: h_res_transposed must be the pre's: the pre's backward "
                             "applies H_res to the post's gradient")
        if isinstance(pre_node, Pre._backward_cls) and \
                pre_node.cfg.arithmetic != cfg.arithmetic:
            raise ValueError("mhc_cg post: the arithmetic must be the pre's: the pre's backward "
                             "differentiates the post's mappings")
        width = x.shape[-1]
        xf, sf, yf = x.reshape(-1, width), state.reshape(-1, state.shape[-1]), y.reshape(-1, y.shape[-1])
        maps = ops.post_maps(sf[None], bias[None], a_post, a_res, width, cfg.n, cfg.iterations,
                             cfg.use_triton, cfg.arithmetic)[0]
        next_state = None
        args = (xf, sf, maps, a_pre, a_post, a_res, bias, yf, seed, cfg.p, cfg.stream, cfg.n,
                cfg.iterations, cfg.use_triton)
        if nxt is not None:
            result, next_state = _post_state(xf, maps, yf, seed, cfg, out, nxt, state_out)
            ctx.mark_non_differentiable(next_state)  # the next pre's backward owns its gradient
        elif out is None:
            result = ops.post(*args, cfg.h_res_transposed)
        else:
            target = _flat_target(out, width)
            ops.post_into(*args, target.writer, cfg.h_res_transposed)
            result = target.view()
        ctx.save_for_backward(x, state, a_pre, a_post, a_res, bias, y, seed)
        ctx.cfg = cfg
        # the pre that made the state takes the post's reductions into its first pass
        ctx.pair = pre_node.pair if _defers_to(pre_node, cfg, (a_pre, a_post, a_res, bias)) \
            else None
        if ctx.pair is not None:
            ctx.pair.expects_post = True
        ctx.link = None
        if ctx.pair is not None and nxt is not None:  # the next pre computes g_y: link it
            ctx.link = PostLink(sf, a_post, bias, seed, cfg.p, cfg.stream, y.dtype)
        link.append(ctx.link)
        ctx.grad_owned = grad_owned  # the output's gradient comes in a graph's own buffer
        ctx.set_materialize_grads(False)  # no zeros for the next state's gradient, never used
        return result.view(x.shape), next_state

    @staticmethod
    def backward(ctx, g, _g_next_state):
        x, state, a_pre, a_post, a_res, bias, y, seed = ctx.saved_tensors
        cfg = ctx.cfg
        width = x.shape[-1]
        # the chain's own gradient: the next pre's backward wrote it, or a graph's buffer holds it
        writable = g is not None and (ctx.grad_owned
                                      or (ctx.link is not None and ctx.link.wrote(g)))
        g = torch.zeros_like(x) if g is None else g
        gf, sf = g.reshape(-1, width), state.reshape(-1, state.shape[-1])
        yf = y.reshape(-1, y.shape[-1])
        # g goes on as x_on's: the pre's backward adds H_res^T g (see the module docstring)
        if ctx.pair is None:
            g_state, g_params, g_y = ops.post_backward(
                gf, x.reshape(-1, width), sf, a_pre, a_post, a_res, bias, yf, seed, cfg.p,
                cfg.stream, cfg.n, cfg.iterations, cfg.use_triton, cfg.h_res_transposed,
                cfg.arithmetic)
            return (g, g_state.view(state.shape), *_alphas_and_bias(g_params, bias),
                    g_y.view(y.shape), None, None, None, None, None, None, None)
        # deferred: the pre's backward reduces (its state and parameter gradients include ours)
        ctx.pair.tail = PostTail(g, yf, seed, cfg.p, cfg.stream, writable)
        g_y = ctx.link.take(g) if ctx.link is not None else None
        ctx.link = None
        if g_y is None:
            g_y = ops.post_grad_y(gf, sf, a_post, bias, seed, cfg.p, cfg.stream, cfg.n, y.dtype,
                                  cfg.use_triton)
        return (g, None, None, None, None, None, g_y.view(y.shape), None, None, None, None, None,
                None, None)


def _defers_to(pre_node, cfg: PostConfig, params: tuple) -> bool:
    """Whether a post with ``params`` hands its reductions to the pre backward node
    ``pre_node`` (the one that made its state, on the same kernels, with the same parameters)."""
    return (isinstance(pre_node, Pre._backward_cls) and pre_node.cfg.use_triton == cfg.use_triton
            and pre_node.cfg.n == cfg.n and pre_node.cfg.iterations == cfg.iterations
            and pre_node.cfg.arithmetic == cfg.arithmetic
            and all(a is b for a, b in zip(pre_node.params, params)))


def _post_state(xf: Tensor, maps: Tensor, yf: Tensor, seed: Tensor | None, cfg: PostConfig,
                out: Target | None, nxt: NextPre,
                state_out: Target | None) -> tuple[Tensor, Tensor]:
    """The post with the next pre's state (:func:`ops.post_state`), into ``out`` and
    ``state_out`` when given."""
    args = (xf, maps, yf, seed, cfg.p, cfg.stream, cfg.n, nxt.weight, nxt.a_pre, nxt.bias,
            nxt.norm, nxt.eps, cfg.use_triton)
    if out is None and state_out is None:
        return ops.post_state(*args, cfg.h_res_transposed, nxt.arithmetic)
    width, sw = xf.shape[-1], state_width(nxt.weight.shape[0])
    out = _flat_target(out or Target.of(torch.empty_like(xf)), width)
    state_out = _flat_target(state_out or Target.of(
        xf.new_empty(xf.shape[0], sw, dtype=state_dtype(xf.dtype))), sw)
    ops.post_state_into(*args, out.writer, state_out.writer, cfg.h_res_transposed, nxt.arithmetic)
    return out.view(), state_out.view()


def _alphas_and_bias(g_params: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``g_params = [g_bias (m) | g_a_pre, g_a_post, g_a_res]`` -> the parameters' order."""
    m = bias.shape[0]
    return g_params[m:m + 1], g_params[m + 1:m + 2], g_params[m + 2:m + 3], g_params[:m]
