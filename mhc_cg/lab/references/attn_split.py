"""Mode ``attn_split``: the attention consumer graphed, mHC ops eager under eager block recompute.

The split Megatron-LM's development branch ships for mHC recompute with CUDA graphs (attention-only
graph scope with mHC selective recompute): per layer, the attention is captured as a graph whose
input is the one-stream ``[s, b, C]`` F input; the mHC ops (the fused pre and post) and the whole
MLP sublayer run eagerly, as checkpoints of the eager block recompute
(:mod:`mhc_cg.recompute.block_recompute`). Megatron's graph also holds the sublayer's RMSNorm; here
the norm is fused into the pre. It is the strongest public alternative to ``graphed_static``, so
the bench runs it beside ours.

F's input is written straight into the graph's static input, which the block recompute reads
as data (:mod:`mhc_cg.lab.references.split_attention`): the replay copies nothing.

Numbers: the graph computes ``fn`` with the eager ops, and everything else is eager block
recompute, so on the ``tape`` backend losses and gradients equal ``eager_none``'s bit for bit
(``tests/test_attn_split.py``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from mhc_cg.model import MHCGPT
from mhc_cg.graphs.graphed_callables import GraphOptions
from mhc_cg.modes.lifecycle import (CapturedState, ModeModel, one_microbatch,
                                            rewind_replay_order, runs_graphs, warmups)
from mhc_cg.modes.plan import CapturePlan
from mhc_cg.recompute.block_recompute import ARMED, BlockRecomputeManager, run_recompute_blocks
from mhc_cg.lab.references.split_attention import AttentionSplit


class AttentionConsumer(nn.Module):
    """The captured part of an attention sublayer: ``F's input [s, b, C] -> fn(...)``."""

    def __init__(self, sub: nn.Module):
        super().__init__()
        self.fn = sub.fn

    def forward(self, fn_input: Tensor) -> Tensor:
        return self.fn(fn_input)


class AttnSplitModel(ModeModel):
    """``model`` trained in the ``attn_split`` mode; ``prepare(device)`` captures the graphs."""

    graphed = True

    def __init__(self, model: MHCGPT, plan: CapturePlan, *, micro_batch_size: int, new_api=None):
        super().__init__(model, plan, micro_batch_size=micro_batch_size, new_api=new_api)
        self.block_size = model.cfg.resolved_recompute_layers
        self.consumers: list[Callable[[Tensor], Tensor]] = []
        self.slots: list[Tensor] = []  # each consumer graph's static input, [s, b, C]
        self.recompute_managers: list[BlockRecomputeManager] = []

    def prepare(self, device: torch.device | str) -> "AttnSplitModel":
        cfg = self.model.cfg
        dtype = self.model.embedding.weight.dtype
        modules = tuple(AttentionConsumer(layer.attention) for layer in self.model.layers)
        samples = tuple((torch.zeros(cfg.seq_length, self.micro_batch_size, cfg.hidden_size,
                                     device=device, dtype=dtype, requires_grad=True),)
                        for _ in modules)
        api = self.capture_api()
        graphed = api.make_graphed_callables(modules, samples, num_warmup_iters=warmups(api),
                                             clone_param_grads_on_return=False,
                                             **one_microbatch(api, len(modules)),
                                             options=GraphOptions())
        self.graphed_callables = graphed
        self.graph_labels = [f"L{layer.layer_number}.attn.core" for layer in self.model.layers]
        self.consumers = list(graphed)
        self.slots = [sample[0] for sample in samples]
        self.captured = CapturedState.of(self.model)
        return self

    def forward(self, input_ids: Tensor, dropout_seed: Tensor) -> Tensor:
        if not self.consumers:
            raise RuntimeError("AttnSplitModel.prepare(device) must run before forward")
        if not runs_graphs(self.model):  # evaluation: the plain model, no graph, no recompute
            return self.model(input_ids, dropout_seed)
        self.captured.check(self.model)
        dropout_seed = self.graph_seed(input_ids, dropout_seed)
        self.recompute_managers = []
        x = run_recompute_blocks(self.model.layers, self.model.embed(input_ids), dropout_seed,
                                 self.block_size, self.recompute_managers,
                                 attention_sublayer=AttentionSplit(self.consumers, self.slots),
                                 ranges=True,
                                 draws_random=self.model.cfg.draws_random)
        return self.model.logits(x)

    def release_pending(self) -> int:
        """Forget a training forward whose backward never came (an aborted step): its block
        managers let go of their checkpoints and the next forward replays from the first graph."""
        for manager in self.recompute_managers:
            if manager.state == ARMED:
                manager.abandon()
        return rewind_replay_order(self.graphed_callables)

    def describe(self) -> dict:
        return {**super().describe(), "block_size": self.block_size, "recompute_graphs": 0,
                "static_input_bytes": sum(s.numel() * s.element_size() for s in self.slots)}
