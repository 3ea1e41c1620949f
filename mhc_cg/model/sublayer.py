"""One residual branch of the mHC GPT, and the two shapes a runtime can drive a branch in.

**Fused** (:class:`MHCSublayer`, ``fused = True``): the mHC work is two ops around F::

    fn_input, state, x_on = pre(x)              # x read once: mappings state, aggregate, norm
    y   = fn(fn_input)                           # F: attention or MLP (never recomputed)
    out = post(x_on, state, y, seed)             # H_res x + dropout(H_post y), one pass

``state`` (``[proj | xnorm | rstd]`` per token) is all the mappings are derived from. A sublayer
that :meth:`MHCSublayer.feeds` the next computes that one's state in its post, from the tiles it
writes, so every pre but the first reads its input once. ``pre`` and
``post`` can write into buffers they are given (:class:`mhc_cg.ops.kernels.Target`), and a block's
chain of residual updates can be recomputed in one op (:func:`mhc_cg.ops.kernels.recompute_block`).

**Stepwise** (adapters of foreign layers, e.g. Megatron-LM main's, op for op): six named steps::

    h_pre, h_post, h_res = mappings(x)
    y     = fn(norm(aggregate(x, h_pre)))
    out   = post_bda(y, h_post, h_res_step(h_res, x), seed)

:func:`sublayer_forward` runs either; the recompute runtimes do too.
"""

from __future__ import annotations

from torch import Tensor, nn

from mhc_cg.config import MHCGPTConfig
from mhc_cg.model.layers import MLP, RMSNorm
from mhc_cg.ops.dropout import dropout
from mhc_cg.ops.hyper_connection import HyperConnection
from mhc_cg.ops.kernels import PostLink, StreamLedger, Target


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


class MHCSublayer(nn.Module):
    """One residual branch: mHC around F (attention or MLP), fused."""

    fused = True

    def __init__(self, cfg: MHCGPTConfig, fn: nn.Module, dropout_stream: int,
                 ledger: StreamLedger | None = None):
        super().__init__()
        self.cfg = cfg
        self.hc = HyperConnection(cfg.hidden_size, cfg.num_streams, cfg.sinkhorn_iterations,
                                  cfg.init_gating_factor, kernels=cfg.kernels, ledger=ledger)
        self.norm = RMSNorm(cfg.hidden_size, kernels=cfg.kernels)
        self.fn = fn
        self.dropout_stream = dropout_stream  # unique per (layer, sublayer) within a microbatch
        self._next: MHCSublayer | None = None  # the sublayer whose pre reads this post's output

    def feeds(self, nxt: "MHCSublayer | None") -> None:
        """``nxt``'s pre reads this sublayer's output: the post computes that pre's state from
        the tiles it writes, and the pre reads its input once (same bits as computing it).
        None: the post computes no state (its output crosses a graph's edge, say)."""
        same = nxt is not None and (nxt.hc.kernels == self.hc.kernels
                                    and nxt.hc.num_streams == self.hc.num_streams
                                    and nxt.hc.hidden_size == self.hc.hidden_size)
        # a plain attribute, not a submodule: deepcopy maps it to the copy's sublayer
        object.__setattr__(self, "_next", nxt if same else None)

    @property
    def dropout_p(self) -> float:
        """The dropout rate in effect: 0 in eval."""
        return self.cfg.hidden_dropout if self.training else 0.0

    def pre(self, x: Tensor, fn_input_out: Target | None = None,
            state_out: Target | None = None, state: Tensor | None = None,
            link: PostLink | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(F's input, state, x_on)``; see the module docstring. ``state``: x's state as the
        post before computed it (:meth:`post`'s ``state_out``); ``link``: that post's link."""
        return self.hc.pre(x, self.norm.weight, self.norm.eps, fn_input_out, state_out, state,
                           link)

    def post(self, x_on: Tensor, state: Tensor, y: Tensor, seed: Tensor | None,
             out: Target | None = None, *, nxt: "MHCSublayer | None" = None,
             state_out: Target | None = None) -> Tensor:
        """``H_res x + dropout(H_post y)`` (F's bias is inside ``y``); with a next sublayer (the
        one this sublayer :meth:`feeds`, or ``nxt``) also its pre's state, into ``state_out``
        when given."""
        nxt = nxt or self._next
        next_pre = None if nxt is None else nxt.hc.next_pre(nxt.norm.weight, nxt.norm.eps)
        return self.hc.post(x_on, state, y, seed, self.dropout_p, self.dropout_stream,
                            self.cfg.dropout_impl, out, next_pre, state_out)

    def handed_link(self, out: Tensor) -> PostLink | None:
        """The link :meth:`post` handed on with its output ``out`` (to the next pre's backward)."""
        return self.hc.ledger.link(out)

    def forward(self, x: Tensor, seed: Tensor | None = None) -> Tensor:
        return sublayer_forward(self, x, seed)


class PlainSublayer(nn.Module):
    """One residual branch without mHC, ``x + dropout(F(norm(x)))``: the plain residual the mHC
    paper measures its overhead against (``model.residual: plain``), F and dropout as in
    :class:`MHCSublayer`."""

    fused = None  # neither shape: no mHC steps for a runtime to drive

    def __init__(self, cfg: MHCGPTConfig, fn: nn.Module, dropout_stream: int,
                 ledger: StreamLedger | None = None):
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.hidden_size, kernels=cfg.kernels)
        self.fn = fn
        self.dropout_stream = dropout_stream

    def feeds(self, nxt) -> None:
        """Nothing to hand on: there is no mapping state."""

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


def recomputes_activation(sub) -> bool:
    """Whether ``sub`` is a dense MLP sublayer whose gelu output is recomputed."""
    return isinstance(sub.fn, MLP) and sub.fn.recompute_activation
