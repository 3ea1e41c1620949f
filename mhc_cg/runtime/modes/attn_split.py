"""Mode ``attn_split``: the attention consumer graphed, mHC ops eager under eager block recompute.

The split Megatron-LM's development branch ships for mHC recompute with CUDA graphs (attention-only
graph scope with mHC selective recompute): per layer, the attention sublayer's RMSNorm and
attention are captured as one graph whose input is the one-stream aggregate ``[s, b, C]``;
mappings, aggregate, ``h_res``, ``h_post``, bias-dropout-add and the whole MLP sublayer run
eagerly, as checkpoints of the eager block recompute (:mod:`mhc_cg.runtime.recompute.eager`). It is the
strongest public alternative to ``graphed_static``, so the bench runs it beside ours.

The aggregate is written straight into the graph's static input, in the forward and in the
recompute (:class:`StaticInputCheckpoint`), so the replay copies nothing and the aggregate costs
no memory of its own: the static input is the only copy. That buffer is the graph's, so "discard"
must not free it; the recompute overwrites it in place before the graph's backward replays (the
block's unified recompute runs before any backward node of the block).

Numbers: the graph computes ``fn(norm(agg))`` with the eager ops, and everything else is eager
block recompute, so on the ``tape`` backend losses and gradients equal ``eager_none``'s bit for bit
(``tests/test_attn_split.py``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from mhc_cg.core import traffic
from mhc_cg.model import MHCGPT
from mhc_cg.runtime.graphs.graphed_callables import make_graphed_callables
from mhc_cg.runtime.modes.lifecycle import (CapturedState, ModeModel, rewind_replay_order,
                                    runs_graphs)
from mhc_cg.runtime.modes.plan import CapturePlan
from mhc_cg.core.nvtx import nvtx_range
from mhc_cg.runtime.recompute.checkpoint import FORWARD, DISCARDED, CheckpointWithoutOutput
from mhc_cg.runtime.recompute.eager import ARMED, BlockRecomputeManager, checkpoint_sublayer


class AttentionConsumer(nn.Module):
    """The captured part of an attention sublayer: ``agg [s, b, C] -> fn(norm(agg))``."""

    def __init__(self, sub: nn.Module):
        super().__init__()
        self.norm, self.fn = sub.norm, sub.fn

    def forward(self, agg: Tensor) -> Tensor:
        return self.fn(self.norm(agg))


def static_view(buffer: Tensor) -> Tensor:
    """A new tensor over ``buffer``'s bytes with its own autograd identity.

    The checkpoint's Function attaches its node to the tensor it returns; returning the graph's
    static input itself (a leaf that requires grad) would graft that node onto the graph's buffer.
    """
    view = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    view.set_(buffer.untyped_storage(), buffer.storage_offset(), buffer.shape, buffer.stride())
    return view


class StaticInputCheckpoint(CheckpointWithoutOutput):
    """A checkpoint whose single output lives in a graph's static input ``slot``.

    Discard keeps the bytes (they are the graph's input buffer; freeing them would break every
    replay) and only checks the output still points at the slot; the recompute writes the slot in
    place through the base class's writer alias.
    """

    def __init__(self, manager: BlockRecomputeManager, slot: Tensor, *, name: str):
        super().__init__(manager, name=name)
        self.slot = slot

    def discard_outputs(self) -> None:
        if self.state != FORWARD:
            raise RuntimeError(f"checkpoint {self.name!r}: cannot discard in state {self.state!r}")
        (out,) = self.outputs
        if out.data_ptr() != self.slot.data_ptr():
            raise RuntimeError(f"checkpoint {self.name!r}: its output is not the graph's static "
                               f"input any more (address {out.data_ptr():#x} != "
                               f"{self.slot.data_ptr():#x}); the aggregate must write the slot")
        self.state = DISCARDED


def aggregate_into(steps, slot: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """``steps.aggregate`` writing ``slot`` when it runs without grad (the checkpoint's forward);
    with grad (the recompute) it returns the value and the checkpoint copies it into ``slot``."""
    def aggregate(x: Tensor, h_pre: Tensor) -> Tensor:
        agg = steps.aggregate(x, h_pre)
        if torch.is_grad_enabled():
            return agg
        with traffic.runtime_copy("static inputs"):
            slot.copy_(agg)
        return static_view(slot)
    return aggregate


def split_attention_sublayer(steps, consumer: Callable[[Tensor], Tensor], slot: Tensor, x: Tensor,
                             seed: Tensor | None, manager: BlockRecomputeManager, name: str,
                             x_source: str | None) -> tuple[Tensor, str]:
    """An attention sublayer: eager checkpointed mHC ops around the graphed ``consumer``.

    Same step order as :func:`mhc_cg.runtime.recompute.eager.checkpoint_sublayer`, with the norm moved
    into the graph and the aggregate written into ``slot`` (the consumer graph's static input).
    The attention sublayer never ends a block (its layer's MLP follows), so its bias-dropout-add
    is always a checkpoint.
    """
    def step(suffix: str) -> CheckpointWithoutOutput:
        return CheckpointWithoutOutput(manager, name=f"{name}/{suffix}")

    x_refill = {} if x_source is None else {0: x_source}
    h_pre, h_post, h_res = step("mappings").checkpoint(
        steps.mappings, x, refill=x_refill, output_keys=("h_pre", "h_post", "h_res"))
    agg = StaticInputCheckpoint(manager, slot, name=f"{name}/aggregate").checkpoint(
        aggregate_into(steps, slot), x, h_pre, refill={**x_refill, 1: f"{name}/mappings.h_pre"})
    y = consumer(agg)
    mixed = step("h_res").checkpoint(
        steps.h_res_step, h_res, x,
        refill={0: f"{name}/mappings.h_res", **({} if x_source is None else {1: x_source})})
    out = step("post_bda").checkpoint(steps.post_bda, y, h_post, mixed, seed,
                                      refill={1: f"{name}/mappings.h_post", 2: f"{name}/h_res"})
    return out, f"{name}/post_bda"


class AttnSplitModel(ModeModel):
    """``model`` trained in the ``attn_split`` mode; ``prepare(device)`` captures the graphs."""

    graphed = True

    def __init__(self, model: MHCGPT, plan: CapturePlan, *, micro_batch_size: int, backend=None):
        super().__init__(model, plan, micro_batch_size=micro_batch_size, backend=backend)
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
        graphed = make_graphed_callables(modules, samples, backend=self.capture_backend())
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
        layers = list(self.model.layers)
        x = self.model.embed(input_ids)
        self.recompute_managers = []
        for start in range(0, len(layers), self.block_size):
            block = layers[start:start + self.block_size]
            manager = BlockRecomputeManager(name=f"block{start // self.block_size}")
            self.recompute_managers.append(manager)
            with manager.forward_scope():
                x_source = None  # the block input is kept, not refilled
                for i, layer in enumerate(block, start):
                    with nvtx_range("fwd", 0, None, f"{i}.attn"):
                        x, x_source = split_attention_sublayer(
                            layer.attention, self.consumers[i], self.slots[i], x, dropout_seed,
                            manager, f"layer{i}/attention", x_source)
                    with nvtx_range("fwd", 0, None, f"{i}.mlp"):  # named as graphed_static's
                        x, x_source = checkpoint_sublayer(
                            layer.mlp, x, dropout_seed, manager, f"layer{i}/mlp", x_source,
                            block_end=layer is block[-1])
                manager.discard_all_outputs_and_register_unified_recompute(x)
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
