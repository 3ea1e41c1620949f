"""A small top-k routed MoE MLP, and megatron-core's partial-capture types it raises and reads.

``MoECudaGraphPartialCaptureSignal`` ends a MoE layer's graph capture early (after the router, or
after the dispatcher's preprocess); ``MoECudaGraphTensorStore`` carries the replayed graph's outputs
into the eager remainder. We use megatron-core's own classes, not look-alikes, so that code which
catches Megatron's signal catches ours. Importing megatron.core warns about TE and Apex on machines
without them; those warnings say nothing about this use and are silenced here.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from mhc_cg.config import MHCGPTConfig
from mhc_cg.model.layers import MLP

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
        MoECudaGraphPartialCaptureSignal,
        MoECudaGraphTensorStore,
    )

__all__ = ["MoECudaGraphPartialCaptureSignal", "MoECudaGraphTensorStore", "MoEDispatchState",
           "MoEMLP"]


class MoEDispatchState:
    """What the preprocess step hands to dispatch; the names are the graph outputs that Megatron's
    partial-capture signal collects (``cudagraph_attrs``) when capture ends after preprocess."""

    cudagraph_attrs = ["tokens_per_expert", "token_order"]

    def __init__(self):
        self.tokens_per_expert: Tensor | None = None  # [E] int64, on device
        self.token_order: Tensor | None = None  # [E, T] int64: per expert, its tokens first
        self.valid_cudagraph_attrs: list[str] | None = None


class MoEMLP(nn.Module):
    """A small top-k routed MoE MLP, ``[s, b, C] -> [s, b, C]``, in three steps:

    * ``route``: router logits, softmax, top-k -> dense ``probs [T, E]`` and ``routing_map [T, E]``;
    * ``preprocess``: per-expert token counts and order, on device, static shapes;
    * ``dispatch``: each expert runs on its tokens (data-dependent shapes: never graph-capturable).

    ``forward(x, partial_capture="route" | "preprocess")`` stops after that step by raising
    megatron-core's ``MoECudaGraphPartialCaptureSignal`` (what a graph's capture passes);
    ``forward(x, store)`` with a filled ``MoECudaGraphTensorStore`` resumes after the captured
    steps from the replayed graph's outputs.
    """

    def __init__(self, cfg: MHCGPTConfig):
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg, ffn_hidden_size=cfg.moe_ffn_hidden_size) for _ in range(cfg.num_experts))
        self.token_dispatcher = MoEDispatchState()

    def route(self, x2d: Tensor) -> tuple[Tensor, Tensor]:
        scores = torch.softmax(self.router(x2d).float(), dim=-1)
        top_p, top_i = scores.topk(self.top_k, dim=-1)
        probs = torch.zeros_like(scores).scatter(1, top_i, top_p / top_p.sum(-1, keepdim=True))
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_i, True)
        return probs.to(x2d.dtype), routing_map

    def preprocess(self, routing_map: Tensor) -> None:
        state = self.token_dispatcher
        state.tokens_per_expert = routing_map.sum(0)
        state.token_order = torch.argsort(routing_map.t().to(torch.int8), dim=1, descending=True,
                                          stable=True)

    def dispatch(self, x2d: Tensor, probs: Tensor) -> Tensor:
        state = self.token_dispatcher
        counts = state.tokens_per_expert.tolist()  # the host sync that ends any graph capture
        out = torch.zeros_like(x2d)
        for e, expert in enumerate(self.experts):
            if counts[e]:
                idx = state.token_order[e, :counts[e]]
                out = out.index_add(0, idx, expert(x2d[idx]) * probs[idx, e:e + 1])
        return out

    def forward(self, x: Tensor, store=None, partial_capture: str | None = None) -> Tensor:
        s, b, c = x.shape
        x2d = x.reshape(s * b, c)
        if store is not None and not store.is_empty():
            x2d, probs = store.hidden_states, store.probs
            if store.routing_map is not None:  # capture ended after route
                self.preprocess(store.routing_map)
        else:
            probs, routing_map = self.route(x2d)
            if partial_capture == "route":
                raise MoECudaGraphPartialCaptureSignal(self, "route", probs=probs,
                                                       routing_map=routing_map)
            self.preprocess(routing_map)
            if partial_capture == "preprocess":
                raise MoECudaGraphPartialCaptureSignal(self, "preprocess", hidden_states=x2d,
                                                       probs=probs)
        return self.dispatch(x2d, probs).view(s, b, c)
