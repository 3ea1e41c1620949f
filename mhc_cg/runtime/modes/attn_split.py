"""Mode ``attn_split``: the attention consumer graphed, mHC ops eager under eager block recompute.

The split Megatron-LM's development branch ships for mHC recompute with CUDA graphs (attention-only
graph scope with mHC selective recompute): per layer, the attention is captured as a graph whose
input is the one-stream ``[s, b, C]`` F input; the mHC ops (the fused pre and post) and the whole
MLP sublayer run eagerly, as checkpoints of the eager block recompute
(:mod:`mhc_cg.runtime.recompute.eager`). Megatron's graph also holds the sublayer's RMSNorm; here
the norm is fused into the pre. It is the strongest public alternative to ``graphed_static``, so
the bench runs it beside ours.

F's input is written straight into the graph's static input, in the forward and in the recompute
(:class:`StaticInputCheckpoint`), so the replay copies nothing and it costs no memory of its own:
the static input is the only copy. That buffer is the graph's, so "discard" must not free it; the
recompute overwrites it in place before the graph's backward replays (the block's unified
recompute runs before any backward node of the block).

Numbers: the graph computes ``fn`` with the eager ops, and everything else is eager block
recompute, so on the ``tape`` backend losses and gradients equal ``eager_none``'s bit for bit
(``tests/test_attn_split.py``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from mhc_cg.model import MHCGPT
from mhc_cg.ops.kernels import Target
from mhc_cg.runtime.graphs.graphed_callables import make_graphed_callables
from mhc_cg.runtime.modes.lifecycle import (CapturedState, ModeModel, rewind_replay_order,
                                    runs_graphs)
from mhc_cg.runtime.modes.plan import CapturePlan
from mhc_cg.runtime.recompute.checkpoint import FORWARD, CheckpointWithoutOutput
from mhc_cg.runtime.recompute.eager import ARMED, BlockRecomputeManager, run_recompute_blocks
from mhc_cg.core.storage import own_version_alias


class AttentionConsumer(nn.Module):
    """The captured part of an attention sublayer: ``F's input [s, b, C] -> fn(...)``."""

    def __init__(self, sub: nn.Module):
        super().__init__()
        self.fn = sub.fn

    def forward(self, fn_input: Tensor) -> Tensor:
        return self.fn(fn_input)


def static_view(buffer: Tensor) -> Tensor:
    """A new tensor over ``buffer``'s bytes with its own autograd identity.

    The checkpoint's Function attaches its node to the tensor it returns; returning the graph's
    static input itself (a leaf that requires grad) would graft that node onto the graph's buffer.
    """
    return own_version_alias(buffer)


class StaticInputCheckpoint(CheckpointWithoutOutput):
    """A checkpoint whose output ``index`` lives in a graph's static input ``slot``.

    Discard keeps those bytes (they are the graph's input buffer; freeing them would break every
    replay) and only checks the output still points at the slot; the recompute writes the slot in
    place through the base class's writer alias. Its other outputs are discarded as usual.
    """

    def __init__(self, manager: BlockRecomputeManager, slot: Tensor, index: int, *, name: str):
        super().__init__(manager, name=name)
        self.slot, self.index = slot, index

    def discard_outputs(self) -> None:
        if self.state != FORWARD:
            raise RuntimeError(f"checkpoint {self.name!r}: cannot discard in state {self.state!r}")
        out = self.outputs[self.index]
        if out.data_ptr() != self.slot.data_ptr():
            raise RuntimeError(f"checkpoint {self.name!r}: its output is not the graph's static "
                               f"input any more (address {out.data_ptr():#x} != "
                               f"{self.slot.data_ptr():#x}); F's input must be written there")
        kept = self.passthrough
        self.passthrough = frozenset(kept | {self.index})  # kept, and restored by the recompute
        try:
            super().discard_outputs()
        finally:
            self.passthrough = kept


def pre_into(steps, slot: Tensor) -> Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]:
    """``steps.pre`` writing F's input into ``slot`` when it runs without grad (the checkpoint's
    forward); with grad (the recompute) it returns the value and the checkpoint copies it into
    ``slot``."""
    def pre(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if torch.is_grad_enabled():
            return steps.pre(x)
        return steps.pre(x, fn_input_out=Target(slot, static_view(slot)))
    return pre


def split_attention_sublayer(steps, consumer: Callable[[Tensor], Tensor], slot: Tensor, x: Tensor,
                             seed: Tensor | None, manager: BlockRecomputeManager, name: str,
                             x_source: str | None) -> tuple[Tensor, str]:
    """An attention sublayer: eager checkpointed pre and post around the graphed ``consumer``.

    The same checkpoints as :func:`mhc_cg.runtime.recompute.eager.checkpoint_sublayer`, with F's
    input written into ``slot`` (the consumer graph's static input). The attention sublayer never
    ends a block (its layer's MLP follows), so its post is always a checkpoint.
    """
    x_refill = {} if x_source is None else {0: x_source}
    fn_input, state, x_on = StaticInputCheckpoint(manager, slot, 0, name=f"{name}/pre").checkpoint(
        pre_into(steps, slot), x, refill=x_refill, output_keys=("fn_input", "state", "x_on"),
        passthrough=(2,))
    y = consumer(fn_input)
    out = CheckpointWithoutOutput(manager, name=f"{name}/post").checkpoint(
        steps.post, x_on, state, y, seed, refill={0: f"{name}/pre.x_on", 1: f"{name}/pre.state"})
    return out, f"{name}/post"


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
        graphed = make_graphed_callables(modules, samples, backend=self.capture_backend(),
                                         keep_param_grads=True)
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
                                 attention=self._split_attention, ranges=True,
                                 draws_random=self.model.cfg.draws_random)
        return self.model.logits(x)

    def _split_attention(self, i: int, layer, x: Tensor, seed: Tensor, manager,
                         x_source) -> tuple[Tensor, object]:
        return split_attention_sublayer(layer.attention, self.consumers[i], self.slots[i], x, seed,
                                        manager, f"layer{i}/attention", x_source)

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
