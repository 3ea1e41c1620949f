"""Where a block of fused sublayers keeps its mHC tensors: every buffer named, nothing copied in.

Sublayer ``j`` of a block of ``S`` (its record's ``slot``, :mod:`~mhc_cg.runtime.chunk`):

* its stream input is the block's input (persistent set) for ``j = 0``, else arena slot
  ``streams[j - 1]``; the pre saves it from there, and the previous sublayer's post writes it there;
* F's input is arena slot ``fn_inputs[j]``, written by the pre, saved by F;
* its mapping state and F's output are the persistent set's (``states``, ``fn_outputs``);
* its output is the next sublayer's stream input, or for the block's last the next block's input.

The arena slots are shared by every block and microbatch of the rank (discard frees nothing); the
block recompute (:func:`mhc_cg.ops.kernels.recompute_block`) writes exactly ``streams[:S-1]`` and
``fn_inputs[:S]`` from the persistent set, which is all the backward reads besides it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhc_cg.ops.kernels import Target
from mhc_cg.runtime.arena import Arena, Slot
from mhc_cg.runtime.chunk import SublayerRecord


class FusedSlots:
    """The arena slots of one block position's streams and F inputs, for blocks of at most
    ``sublayers`` sublayers of the model ``cfg`` at ``[seq_length, micro_batch_size]``."""

    STREAMS, FN_INPUTS = "mhc.streams", "mhc.fn_inputs"

    def __init__(self, arena: Arena, sublayers: int, cfg, seq_length: int, micro_batch_size: int,
                 dtype: torch.dtype):
        self.arena = arena
        self.lead = (seq_length, micro_batch_size)
        self.size = sublayers
        self.width, self.hidden = cfg.num_streams * cfg.hidden_size, cfg.hidden_size
        item = torch.empty((), dtype=dtype).element_size()
        tokens = seq_length * micro_batch_size
        self._streams = arena.fixed_slot(self.STREAMS, max(self.size - 1, 1) * tokens * self.width
                                         * item, dtype)
        self._fn_inputs = arena.fixed_slot(self.FN_INPUTS, self.size * tokens * self.hidden * item,
                                           dtype)

    def _stacked(self, slot: Slot, width: int, writer: bool) -> Tensor:
        flat = self.arena.writer(slot) if writer else self.arena.reader(slot)
        return flat.view(-1, *self.lead, width)

    def _target(self, slot: Slot, width: int, j: int) -> Target:
        writer = self._stacked(slot, width, True)[j]
        name = self.STREAMS if slot is self._streams else self.FN_INPUTS
        self.arena.track(name, j, writer)
        return Target(writer, self._stacked(slot, width, False)[j])

    def stream(self, record: SublayerRecord) -> Target:
        """Where a sublayer past its block's first reads its stream input from."""
        return self._target(self._streams, self.width, record.slot - 1)

    def fn_input(self, record: SublayerRecord) -> Target:
        """Where a sublayer's pre writes F's input."""
        return self._target(self._fn_inputs, self.hidden, record.slot)

    def recompute_outputs(self, sublayers: int) -> tuple[Tensor, Tensor]:
        """``(streams [S-1, ...], fn_inputs [S, ...])`` writers for a block of ``sublayers``."""
        return (self._stacked(self._streams, self.width, True)[:max(sublayers - 1, 0)],
                self._stacked(self._fn_inputs, self.hidden, True)[:sublayers])
