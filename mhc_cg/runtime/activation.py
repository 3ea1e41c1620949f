"""Activation recompute on the static runtime, for an MLP that asks for it: fc1's output goes
to the persistent set (``fc1_outputs``; the gelu saves a view of it), the gelu output to one
arena slot per layer position (its record's ``activation_region``; fc2 saves a view of it), and
the block recompute re-derives the gelu output from the persistent fc1 output into that slot. A
microbatch then keeps fc1's output only, not the activation too; the arena grows by one
activation per block position."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.model import MLP
from mhc_cg.runtime.arena import Arena
from mhc_cg.runtime.chunk import SublayerRecord
from mhc_cg.runtime.persistent import PersistentSlotSet
from mhc_cg.runtime.store import RegionCursor, store_in, store_in_slot


class ActivationSlots:
    """The gelu outputs of a chunk's MLPs that recompute their activation, in ``arena``."""

    def __init__(self, arena: Arena):
        self.arena = arena

    def _cursor(self, record: SublayerRecord) -> RegionCursor:
        return RegionCursor(self.arena, self.arena.region(record.activation_region))

    def mlp(self, record: SublayerRecord, mlp: MLP, normed: Tensor, pset: PersistentSlotSet,
            out: Tensor | None) -> Tensor:
        """``mlp(normed)`` (fc1 -> gelu -> fc2, fc2 into ``out`` where given) with fc1's output
        in ``pset`` and the gelu output in the record's arena slot: a microbatch keeps neither
        the activation nor a second copy of fc1's output; :meth:`refill` writes the slot back."""
        if record.index not in pset.fc1_outputs:
            raise StaticRecomputeError(
                f"persistent set {pset.index} has no fc1 output slot for chunk layer "
                f"{record.index} (it has {sorted(pset.fc1_outputs)}); build the sets from a chunk "
                f"whose layers recompute their activation at least where this chunk's do")
        pre = store_in(mlp.fc1(normed), pset.fc1_outputs[record.index])
        act = F.gelu(pre)  # saves ``pre``: a view of the persistent slot
        act = store_in_slot(act, self._cursor(record))
        return mlp.fc2(act, out)  # saves ``act``: a view of the arena slot

    def refill(self, record: SublayerRecord, pset: PersistentSlotSet) -> None:
        """Write ``gelu`` of the record's persistent fc1 output into its slot."""
        with torch.no_grad():
            self._cursor(record).save(F.gelu(pset.fc1_outputs[record.index]))
