"""Mode ``graphed_none``: every mHC sublayer captured as a graph, with no recompute at all.

The baseline that separates what graphs buy from what static-buffer recompute buys: each
``MHCSublayer`` (attention or MLP, its mHC ops included) goes through ``make_graphed_callables``
as it is, with no static runtime, no arena and no recompute. Whatever autograd saves for backward
lives in the graphs' shared pool, so memory is that of eager without recompute (plus the static
inputs); the numbers are those of eager without recompute, bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .model import MHCGPT


class GraphedSublayersModel:
    """``model`` whose sublayers replay as graphs; ``prepare(device)`` captures them."""

    def __init__(self, model: MHCGPT, *, micro_batch_size: int, backend: str = "auto"):
        if model.cfg.is_moe:
            # the MoE dispatch has data-dependent shapes: a whole-sublayer graph cannot hold it
            raise ValueError("graphed_none captures whole sublayers; a MoE MLP (model.num_experts) "
                             "cannot be captured whole; use graphed_static with moe_router scopes")
        self.model, self.micro_batch_size, self.backend_name = model, micro_batch_size, backend
        self.sublayer_fns: list[Callable] = []
        self.graphed_callables: tuple = ()

    def prepare(self, device: torch.device | str) -> "GraphedSublayersModel":
        from .graphs.graphed_callables import make_graphed_callables

        cfg = self.model.cfg
        modules = tuple(sub for layer in self.model.layers for sub in (layer.attention, layer.mlp))
        width = cfg.num_streams * cfg.hidden_size
        sample_args = tuple(
            (torch.zeros(cfg.seq_length, self.micro_batch_size, width, device=device,
                         requires_grad=True),
             torch.zeros((), dtype=torch.int64, device=device))
            for _ in modules)
        self.graphed_callables = make_graphed_callables(modules, sample_args,
                                                        backend=self.backend_name)
        self.sublayer_fns = list(self.graphed_callables)
        return self

    def forward(self, input_ids: Tensor, dropout_seed: Tensor) -> Tensor:
        if not self.sublayer_fns:
            raise RuntimeError("GraphedSublayersModel.prepare(device) must run before forward")
        x = self.model.embed(input_ids)
        for fn in self.sublayer_fns:
            x = fn(x, dropout_seed)
        return self.model.logits(x)

    __call__ = forward

    def graphs(self) -> list:
        return list(self.graphed_callables.graphs()) if self.graphed_callables else []

    def describe(self) -> dict:
        return {"scopes": ["attn", "mlp"], "graphs": len(self.graphs()), "recompute_graphs": 0}
