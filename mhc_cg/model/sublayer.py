"""One residual branch of the mHC GPT as named steps, so the recompute runtimes can checkpoint,
discard and replay them one by one::

    h_pre, h_post, h_res = mappings(x)        # [s,b,n], [s,b,n], [s,b,n,n]
    agg    = aggregate(x, h_pre)               # [s,b,C]
    normed = norm(agg)                         # [s,b,C]
    y      = fn(normed)                        # [s,b,C]   F: attention or MLP (never recomputed)
    mixed  = h_res_step(h_res, x)              # [s,b,n*C]
    out    = post_bda(y, h_post, mixed, seed)  # [s,b,n*C] = mixed + dropout(h_post * y)

``mappings``, ``aggregate``, ``h_res_step`` and ``post_bda`` are one fused op each, forward and
backward (:mod:`mhc_cg.ops.kernels`; ``model.kernels`` picks Triton or the torch reference). The
megatron adapters (:mod:`megatron_integration.steps`) present megatron's layers under the same
names.
"""

from __future__ import annotations

from torch import Tensor, nn

from mhc_cg.config import MHCGPTConfig
from mhc_cg.model.layers import MLP, RMSNorm
from mhc_cg.ops.hyper_connection import HyperConnection


class HyperConnectionSteps:
    """The mHC steps every sublayer adapter shares, delegated to its hyper-connection ``hc``
    (ours, or Megatron-LM main's ``HyperConnectionModule``: same method names)."""

    hc: nn.Module

    def mappings(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.hc.compute_mappings(x)

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        return self.hc.aggregate(x, h_pre)

    def h_res_step(self, h_res: Tensor, x: Tensor) -> Tensor:
        return self.hc.apply_h_res(h_res, x)


class MHCSublayer(HyperConnectionSteps, nn.Module):
    """One residual branch: mHC around F (attention or MLP), as named steps."""

    def __init__(self, cfg: MHCGPTConfig, fn: nn.Module, dropout_stream: int):
        super().__init__()
        self.cfg = cfg
        self.hc = HyperConnection(cfg.hidden_size, cfg.num_streams, cfg.sinkhorn_iterations,
                                  cfg.init_gating_factor, kernels=cfg.kernels)
        self.norm = RMSNorm(cfg.hidden_size, kernels=cfg.kernels)
        self.fn = fn
        self.dropout_stream = dropout_stream  # unique per (layer, sublayer) within a microbatch

    def post_bda(self, y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None) -> Tensor:
        """h_post and bias-dropout-add (F's bias is inside ``y``): ``mixed + dropout(h_post * y)``."""
        return self.hc.post_bda(y, h_post, mixed, seed, self.cfg.hidden_dropout if self.training else 0.0,
                                self.dropout_stream, self.cfg.dropout_impl)

    def forward(self, x: Tensor, seed: Tensor | None = None) -> Tensor:
        return sublayer_forward(self, x, seed)


def sublayer_forward(steps, x: Tensor, seed: Tensor | None) -> Tensor:
    """The plain mHC sublayer over named steps (an ``MHCSublayer`` or an adapter with its steps,
    e.g. ``megatron_integration.steps.SublayerSteps``)."""
    h_pre, h_post, h_res = steps.mappings(x)
    y = steps.fn(steps.norm(steps.aggregate(x, h_pre)))
    return steps.post_bda(y, h_post, steps.h_res_step(h_res, x), seed)


def recomputes_activation(sub: MHCSublayer) -> bool:
    """Whether ``sub`` is a dense MLP sublayer whose gelu output is recomputed."""
    return isinstance(sub.fn, MLP) and sub.fn.recompute_activation
