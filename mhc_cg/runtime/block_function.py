"""A block's recompute as a function: from a persistent set into the arena slots, F never re-run.

Note [recompute without rebuilding autograd] (docs/design.md, item 2): the function re-runs the
block's mHC ops (the sublayer strategy's ``recompute_block``) and re-derives the gelu output of
each MLP that recomputes its activation, writing exactly the slots the forward wrote: it has
static inputs (the set) and outputs (the arena), so a graph backend captures it once per (block,
set) and replays it (:mod:`mhc_cg.runtime.recompute_captures`); the runtime's backward
decides when it runs (:meth:`mhc_cg.runtime.static.StaticRecompute.run_recompute`).
"""

from __future__ import annotations

from mhc_cg.runtime.activation import ActivationSlots
from mhc_cg.runtime.arena import Arena
from mhc_cg.runtime.chunk import ChunkLayout
from mhc_cg.runtime.persistent import PersistentSlotSet


class BlockRecompute:
    """The recompute of any block of ``layout`` with the sublayer strategy ``sublayers`` and the
    MLPs' ``activations``."""

    def __init__(self, layout: ChunkLayout, arena: Arena, sublayers, activations: ActivationSlots):
        self.layout, self.arena, self.sublayers, self.activations = (layout, arena, sublayers,
                                                                      activations)

    def __call__(self, block: int, pset: PersistentSlotSet) -> None:
        """Re-run block ``block``'s mHC ops from ``pset`` into the arena (no F, nothing
        returned), and the gelu output of each of its MLPs that recomputes its activation."""
        self.arena.touch()
        self.sublayers.recompute_block(block, pset)
        for record in self.layout.blocks[block]:
            if record.recompute_activation:
                self.activations.refill(record, pset)
