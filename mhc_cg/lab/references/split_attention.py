"""Megatron-LM dev's split inside eager block recompute: the attention's core a graph, the mHC
ops around it eager checkpoints (mode ``attn_split``, :mod:`mhc_cg.lab.references.attn_split`).

F's input is written straight into the core graph's static input, in the forward and in the
recompute (:class:`StaticInputCheckpoint`), so the replay copies nothing and it costs no memory of
its own: the static input is the only copy. That buffer is the graph's, so "discard" must not free
it; the recompute overwrites it in place before the graph's backward replays (the block's unified
recompute runs before any backward node of the block). :class:`AttentionSplit` is what the block
recompute reads: per layer, the graphed core and its static input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from mhc_cg.core.storage import own_version_alias
from mhc_cg.ops.kernels import Target
from mhc_cg.recompute.checkpoint import FORWARD, CheckpointWithoutOutput
from mhc_cg.recompute.seam import Relay, handing_post, taking_pre


@dataclass(frozen=True)
class AttentionSplit:
    """Per layer, the attention's graphed core (``F's input [s, b, C] -> fn``) and that graph's
    static input, where F's input is written; called as eager block recompute's
    ``attention_sublayer`` (:func:`split_attention_sublayer` of layer ``i``)."""

    consumers: list[Callable[[Tensor], Tensor]]
    slots: list[Tensor]

    def __call__(self, i: int, steps, x: Tensor, seed: Tensor | None, manager, name: str,
                 x_source: str | None, seam: Relay, nxt):
        return split_attention_sublayer(steps, self.consumers[i], self.slots[i], x, seed,
                                        manager, name, x_source, seam, nxt)


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

    def __init__(self, manager, slot: Tensor, index: int, *, name: str):
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


def pre_into(pre, slot: Tensor) -> Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]:
    """``pre`` writing F's input into ``slot`` when it runs without grad (the checkpoint's
    forward); with grad (the recompute) it returns the value and the checkpoint copies it into
    ``slot``."""
    def run(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if torch.is_grad_enabled():
            return pre(x)
        return pre(x, fn_input_out=Target(slot, static_view(slot)))
    return run


def split_attention_sublayer(steps, consumer: Callable[[Tensor], Tensor], slot: Tensor, x: Tensor,
                             seed: Tensor | None, manager, name: str, x_source: str | None,
                             seam: Relay, nxt) -> tuple[Tensor, str, Relay]:
    """An attention sublayer: eager checkpointed pre and post around the graphed ``consumer``.

    The same checkpoints as :func:`mhc_cg.recompute.block_recompute.checkpoint_sublayer`
    (``seam``, ``nxt`` and what it returns as there), with F's input written into ``slot`` (the
    consumer graph's static input). The attention sublayer never ends a block (its layer's MLP
    follows), so its post is always a checkpoint.
    """
    x_refill = {} if x_source is None else {0: x_source}
    fn_input, state, x_on = StaticInputCheckpoint(manager, slot, 0, name=f"{name}/pre").checkpoint(
        pre_into(taking_pre(steps.pre, seam), slot), x, refill=x_refill,
        output_keys=("fn_input", "state", "x_on"), passthrough=(2,))
    y = consumer(fn_input)
    after = Relay()
    out = CheckpointWithoutOutput(manager, name=f"{name}/post").checkpoint(
        handing_post(steps, nxt, after), x_on, state, y, seed,
        refill={0: f"{name}/pre.x_on", 1: f"{name}/pre.state"})
    return out, f"{name}/post", after


