"""DeepSeek-V4.1's mHC dataflow, the delayed pre (``model.arithmetic: v41``).

Sublayer k reads the streams X its site's coefficients ``pre_k``, ``post_k``, ``comb_k`` come
from (DeepSeek-V4's mappings: :mod:`mhc_cg.ops.hyper_connection`, arithmetic ``v41``), but
collapses them with the pre-mix ``q`` of the site before it::

    F_k's input = norm(sum_j q[j] X_j)
    X'_j        = post_k[j] F_k + sum_i comb_k[i, j] X_i      (comb applied as H_res^T)
    handed on:    (X', pre_k)                                 (sublayer k+1 collapses X' with pre_k)

At the model's entry ``q`` picks stream 0; after the last sublayer its pre-mix folds the streams
before the final norm. So a boundary's collapse needs nothing of the mixes computed there: the
streams can be read once and written once per boundary. What one sublayer hands the next is the
pair :class:`DelayedStreams`; a recompute must start from the pre-mix a block received, besides
its input and F's outputs.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from mhc_cg.core.regions import region
from mhc_cg.model.sublayer import HyperConnectionSteps, MHCBranch


class DelayedStreams(NamedTuple):
    """What passes from sublayer to sublayer: the streams and the pre-mix that collapses them
    next (the last site's, ``[s, b, n]``)."""

    streams: Tensor
    pre_mix: Tensor


def entry(streams: Tensor, num_streams: int) -> DelayedStreams:
    """The model's entry: the expanded streams, the first input their stream 0."""
    pre_mix = streams.new_zeros(*streams.shape[:-1], num_streams)
    pre_mix[..., 0] = 1.0
    return DelayedStreams(streams, pre_mix)


def fold(x: DelayedStreams, num_streams: int) -> Tensor:
    """The streams folded by the last site's pre-mix, ``sum_j q[j] X_j``: the head's input."""
    with region("mhc"):
        return (x.pre_mix.unsqueeze(-1) * x.streams.unflatten(-1, (num_streams, -1))).sum(-2)


class DelayedPreSublayer(HyperConnectionSteps, MHCBranch):
    """One residual branch with the delayed pre, stepwise on torch's ops (autograd differentiates
    them): its ``step`` takes and returns :class:`DelayedStreams`."""

    delayed_pre = True

    def post_bda(self, y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None) -> Tensor:
        return self.hc.post_bda(y, h_post, mixed, seed, self.dropout_p, self.dropout_stream,
                                self.cfg.dropout_impl)

    def step(self, x: DelayedStreams, seed: Tensor | None = None, handoff=None,
             nxt: nn.Module | None = None) -> tuple[DelayedStreams, None]:
        """In a chain (:func:`mhc_cg.model.sublayer.run_chain`): the pre-mix travels in ``x``."""
        return self(x, seed), None

    def forward(self, x: DelayedStreams, seed: Tensor | None = None) -> DelayedStreams:
        streams = x.streams
        h_pre, h_post, h_res = self.mappings(streams)
        y = self.fn(self.norm(self.aggregate(streams, x.pre_mix)))
        return DelayedStreams(self.post_bda(y, h_post, self.h_res_step(h_res, streams), seed),
                              h_pre)
