"""Mode ``graphed_none``: every mHC sublayer captured as a graph, with no recompute at all.

The baseline that separates what graphs buy from what static-buffer recompute buys: each
``MHCSublayer`` (attention or MLP, its mHC ops included) goes through ``make_graphed_callables``
as it is, with no static runtime, no arena and no recompute. A MoE MLP sublayer cannot be
captured whole (its dispatch has data-dependent shapes), so with ``model.num_experts`` only the
attention sublayers are graphs and the MoE sublayers run eagerly. Whatever autograd saves for backward
lives in the graphs' shared pool, so memory is that of eager without recompute (plus the static
inputs); the numbers are those of eager without recompute, bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from mhc_cg.model import MHCGPT, MoEMLP
from mhc_cg.graphs.graphed_callables import GraphOptions
from mhc_cg.graphs.replay_state import grad_output_buffer
from mhc_cg.modes.lifecycle import (CapturedState, ModeModel, one_microbatch,
                                            runs_graphs, warmups)
from mhc_cg.modes.plan import CapturePlan


def sublayer_sample_args(model: MHCGPT, micro_batch_size: int, count: int,
                         device: torch.device | str) -> tuple[tuple[Tensor, Tensor], ...]:
    """``count`` capture samples of a sublayer's inputs: streams ``[s, b, n*C]`` (in the
    parameters' dtype, requiring grad) and an int64 dropout seed."""
    cfg = model.cfg
    width = cfg.num_streams * cfg.hidden_size
    dtype = model.embedding.weight.dtype  # activations follow the parameters
    return tuple((torch.zeros(cfg.seq_length, micro_batch_size, width, device=device, dtype=dtype,
                              requires_grad=True),
                  torch.zeros((), dtype=torch.int64, device=device))
                 for _ in range(count))


class GraphedSublayersModel(ModeModel):
    """``model`` whose sublayers replay as graphs; ``prepare(device)`` captures them."""

    graphed = True

    def __init__(self, model: MHCGPT, plan: CapturePlan, *, micro_batch_size: int, new_api=None):
        super().__init__(model, plan, micro_batch_size=micro_batch_size, new_api=new_api)
        self.sublayer_fns: list[Callable] = []

    def prepare(self, device: torch.device | str) -> "GraphedSublayersModel":
        subs = [sub for layer in self.model.layers for sub in (layer.attention, layer.mlp)]
        captured, labels = [], []
        for layer in self.model.layers:
            for name, sub, on in (("attn", layer.attention, self.plan.attn),
                                  ("mlp", layer.mlp, self.plan.mlp)):
                if on and not isinstance(sub.fn, MoEMLP):
                    captured.append(sub)
                    labels.append(f"L{layer.layer_number}.{name}")
        sample_args = sublayer_sample_args(self.model, self.micro_batch_size, len(captured), device)
        api = self.capture_api()
        self.graphed_callables = api.make_graphed_callables(
            tuple(captured), sample_args, num_warmup_iters=warmups(api),
            clone_param_grads_on_return=False, **one_microbatch(api, len(captured)),
            options=GraphOptions(lend_grads_to_eager=True, grads_owned=True))
        self.graph_labels = labels
        graphed = dict(zip(map(id, captured), self.graphed_callables))
        self.sublayer_fns = [graphed.get(id(sub), sub) for sub in subs]  # MoE: the eager module
        self.captured = CapturedState.of(self.model)
        return self

    def forward(self, input_ids: Tensor, dropout_seed: Tensor) -> Tensor:
        """A training forward replays the graphs; evaluation (``eval()`` or ``no_grad``) runs the
        plain model eagerly and leaves the graphs and their replay order alone."""
        if not self.sublayer_fns:
            raise RuntimeError("GraphedSublayersModel.prepare(device) must run before forward")
        if not runs_graphs(self.model):
            return self.model(input_ids, dropout_seed)
        self.captured.check(self.model)
        dropout_seed = self.graph_seed(input_ids, dropout_seed)
        x = self.model.embed(input_ids)
        for fn in self.sublayer_fns:
            x = fn(x, dropout_seed)
        return self.model.logits(x, grad_into=grad_output_buffer(x))

    def describe(self) -> dict:
        return {**super().describe(), "recompute_graphs": 0}
