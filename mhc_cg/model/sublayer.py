"""One residual branch of the mHC GPT, and the two shapes a runtime can drive a branch in.

**Fused** (:class:`MHCSublayer`, ``fused = True``): the mHC work is two ops around F::

    fn_input, state, x_on = pre(x)              # x read once: mappings state, aggregate, norm
    y   = fn(fn_input)                           # F: attention or MLP (never recomputed)
    out = post(x_on, state, y, seed)             # H_res x + dropout(H_post y), one pass

``state`` (``[proj | xnorm | rstd]`` per token) is all the mappings are derived from. A post
that knows the sublayer after it (:meth:`MHCSublayer.post_feeding`) computes that one's state
from the tiles it writes and returns it with a :class:`~mhc_cg.ops.kernels.Handoff`, which the
caller gives the next pre: every pre but a chain's first then reads its input once. The chain is
the caller's to walk (:func:`run_chain`); no sublayer holds its neighbour. ``pre`` and ``post``
can write into buffers they are given (:class:`mhc_cg.ops.kernels.Target`), and a block's chain
of residual updates can be recomputed in one op (:func:`mhc_cg.ops.kernels.recompute_block`).

**Stepwise** (adapters of foreign layers, e.g. Megatron-LM main's, op for op): six named steps::

    h_pre, h_post, h_res = mappings(x)
    y     = fn(norm(aggregate(x, h_pre)))
    out   = post_bda(y, h_post, h_res_step(h_res, x), seed)

:func:`sublayer_forward` runs either; the recompute runtimes do too.
"""

from __future__ import annotations

from torch import Tensor, nn

from mhc_cg.config import MHCGPTConfig
from mhc_cg.model.layers import RMSNorm
from mhc_cg.ops.dropout import dropout
from mhc_cg.ops.hyper_connection import HyperConnection
from mhc_cg.ops.kernels import Handoff, PostLink, Target


class HyperConnectionSteps:
    """The stepwise mHC steps every sublayer adapter shares, delegated to its hyper-connection
    ``hc`` (ours, or Megatron-LM main's ``HyperConnectionModule``: same method names)."""

    fused = False
    hc: nn.Module

    def mappings(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.hc.compute_mappings(x)

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        return self.hc.aggregate(x, h_pre)

    def h_res_step(self, h_res: Tensor, x: Tensor) -> Tensor:
        return self.hc.apply_h_res(h_res, x)


class FusedSteps:
    """The fused sublayer's steps over its parts: ``hc`` (a :class:`HyperConnectionOps`),
    ``norm`` (``weight`` and ``eps``), ``fn``, ``dropout_p``, ``dropout_stream`` and ``cfg``
    (``dropout_impl``): mhc_cg's :class:`MHCSublayer`, or an adapter of a Megatron layer."""

    fused = True

    def pre(self, x: Tensor, fn_input_out: Target | None = None,
            state_out: Target | None = None, state: Tensor | None = None,
            link: PostLink | None = None, handoff: Handoff | None = None, *,
            grad_owned: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``(F's input, state, x_on)``; see the module docstring. ``state``/``link``: x's state
        as the post before computed it (:meth:`post_feeding`'s ``state_out``) and that post's
        link; ``handoff``: both as that post returned them; ``grad_owned``: ``x_on`` is a graph's
        output (:func:`mhc_cg.ops.kernels.pre`)."""
        return self.hc.pre(x, self.norm.weight, self.norm.eps, fn_input_out, state_out, state,
                           link, handoff, grad_owned=grad_owned)

    def post(self, x_on: Tensor, state: Tensor, y: Tensor, seed: Tensor | None,
             out: Target | None = None, *, grad_owned: bool = False) -> Tensor:
        """``H_res x + dropout(H_post y)`` (F's bias is inside ``y``); ``grad_owned``: see
        :func:`mhc_cg.ops.kernels.post`."""
        return self.hc.post(x_on, state, y, seed, self.dropout_p, self.dropout_stream,
                            self.cfg.dropout_impl, out, grad_owned=grad_owned)

    def post_feeding(self, nxt: "MHCSublayer", x_on: Tensor, state: Tensor, y: Tensor,
                     seed: Tensor | None, out: Target | None = None,
                     state_out: Target | None = None, *,
                     grad_owned: bool = False) -> tuple[Tensor, Handoff | None]:
        """:meth:`post`, and the state of ``nxt``'s pre (into ``state_out`` when given), with
        the handoff for it: ``(output, handoff)``."""
        return self.hc.post_feeding(nxt.hc.next_pre(nxt.norm.weight, nxt.norm.eps), x_on, state,
                                    y, seed, self.dropout_p, self.dropout_stream,
                                    self.cfg.dropout_impl, out, state_out,
                                    grad_owned=grad_owned)

    def step(self, x: Tensor, seed: Tensor | None = None, handoff: Handoff | None = None,
             nxt: nn.Module | None = None) -> tuple[Tensor, Handoff | None]:
        """The sublayer in a chain: its pre takes ``handoff`` (what the post before returned),
        its post computes ``nxt``'s state when it can (:func:`hands_state`); ``(output,
        handoff for nxt)``."""
        fn_input, state, x_on = self.pre(x, handoff=handoff)
        y = self.fn(fn_input)
        if not hands_state(self, nxt):
            return self.post(x_on, state, y, seed), None
        return self.post_feeding(nxt, x_on, state, y, seed)


class MHCBranch(nn.Module):
    """The parts of one mHC residual branch of mhc_cg's GPT: its hyper-connection in the
    config's arithmetic, F's norm, F and its dropout stream; the steps are its subclass's."""

    def __init__(self, cfg: MHCGPTConfig, fn: nn.Module, dropout_stream: int):
        super().__init__()
        self.cfg = cfg
        # dev's and V4.1's arithmetic apply H_res as its transpose (mhc_cg.ops.hyper_connection)
        self.hc = HyperConnection(cfg.hidden_size, cfg.num_streams, cfg.sinkhorn_iterations,
                                  cfg.init_gating_factor, kernels=cfg.kernels,
                                  h_res_transposed=cfg.arithmetic != "main",
                                  arithmetic=cfg.arithmetic)
        self.norm = RMSNorm(cfg.hidden_size, kernels=cfg.kernels)
        self.fn = fn
        self.dropout_stream = dropout_stream  # unique per (layer, sublayer) within a microbatch

    @property
    def dropout_p(self) -> float:
        """The dropout rate in effect: 0 in eval."""
        return self.cfg.hidden_dropout if self.training else 0.0


class MHCSublayer(FusedSteps, MHCBranch):
    """One residual branch: mHC around F (attention or MLP), fused."""

    def forward(self, x: Tensor, seed: Tensor | None = None, *,
                grad_owned: bool = False) -> Tensor:
        """The sublayer alone. ``grad_owned``: a graph captures it, and its output's gradient
        comes in the graph's own buffer (mhc_cg's ``make_graphed_callables`` says so at
        capture)."""
        fn_input, state, x_on = self.pre(x)
        return self.post(x_on, state, self.fn(fn_input), seed, grad_owned=grad_owned)


def hands_state(sub: nn.Module, nxt: nn.Module | None) -> bool:
    """Whether ``sub``'s post can compute ``nxt``'s pre state: both fused mHC sublayers on the
    same kernels and stream shape."""
    return (nxt is not None and getattr(sub, "fused", None) is True
            and getattr(nxt, "fused", None) is True and nxt.hc.kernels == sub.hc.kernels
            and nxt.hc.arithmetic == sub.hc.arithmetic
            and nxt.hc.num_streams == sub.hc.num_streams
            and nxt.hc.hidden_size == sub.hc.hidden_size)


def run_chain(sublayers, x: Tensor, seed: Tensor | None) -> Tensor:
    """``sublayers`` one after the other, each post handing the next pre its state."""
    handoff = None
    for sub, nxt in zip(sublayers, [*sublayers[1:], None]):
        x, handoff = sub.step(x, seed, handoff, nxt)
    return x


class PlainSublayer(nn.Module):
    """One residual branch without mHC, ``x + dropout(F(norm(x)))``: the plain residual the mHC
    paper measures its overhead against (``model.residual: plain``), F and dropout as in
    :class:`MHCSublayer`."""

    fused = None  # neither shape: no mHC steps for a runtime to drive

    def __init__(self, cfg: MHCGPTConfig, fn: nn.Module, dropout_stream: int):
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.hidden_size, kernels=cfg.kernels)
        self.fn = fn
        self.dropout_stream = dropout_stream

    def step(self, x: Tensor, seed: Tensor | None = None, handoff=None,
             nxt: nn.Module | None = None) -> tuple[Tensor, None]:
        """In a chain: nothing to hand on (there is no mapping state)."""
        return self(x, seed), None

    def forward(self, x: Tensor, seed: Tensor | None = None) -> Tensor:
        p = self.cfg.hidden_dropout if self.training else 0.0
        return x + dropout(self.fn(self.norm(x)), p, self.training, impl=self.cfg.dropout_impl,
                           seed=seed, stream=self.dropout_stream)


def sublayer_forward(steps, x: Tensor, seed: Tensor | None) -> Tensor:
    """The plain sublayer, fused (``steps.fused``) or stepwise (the module docstring)."""
    if steps.fused:
        fn_input, state, x_on = steps.pre(x)
        return steps.post(x_on, state, steps.fn(fn_input), seed)
    h_pre, h_post, h_res = steps.mappings(x)
    y = steps.fn(steps.norm(steps.aggregate(x, h_pre)))
    return steps.post_bda(y, h_post, steps.h_res_step(h_res, x), seed)
