"""Static buffers for mHC activations: the per-rank arena and the per-microbatch persistent sets.

Note [arena slots] (docs/design.md, item 1). The arena holds every tensor that autograd saves inside the mHC ops of one recompute block. It is
one byte buffer, allocated once, cut into fixed *regions* (one per sublayer position in a block
and per segment of that sublayer), each a sequence of *slots*. Nothing is ever freed: "discard"
means the next block or microbatch may overwrite a slot; the block's recompute writes it back
before the block's backward reads it.

Two aliases of the same storage keep autograd honest:

* the **reader** (``Arena.buffer``) is what saved tensors are views of. Nobody writes through it,
  so its version counter never moves and autograd never sees an in-place change;
* the **writer** is made once with ``set_`` on the reader's storage; producers ``copy_`` through
  it. Its views share the writer's version counter, not the reader's.

Every write is checked: the slot must have the size, dtype and address the layout fixed when the
region was first filled. A different shape is an error, never a silent re-allocation.

A forward leaves its last block's state in the slots, as that block's recompute would write it.
When that block's backward is the next thing to read the arena (no pipeline, or the last stage of
one), its recompute is skipped: the runtime notes the arena's ``generation`` when its forward
ends, and every other writer (a forward, a recompute, a borrower) starts a new one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mhc_cg.core import regions
from mhc_cg.core.storage import own_version_alias, storage_id
from mhc_cg.graphs.static_inputs import static_buffer

ALIGN_BYTES = 64


@dataclass
class Slot:
    offset: int  # bytes from the arena start
    nbytes: int
    dtype: torch.dtype


@dataclass
class Region:
    """The slots one segment of one sublayer fills, in the order it fills them."""

    name: str
    slots: list[Slot] = field(default_factory=list)
    frozen: bool = False  # True once the arena is allocated: the layout may no longer change

    @property
    def nbytes(self) -> int:
        return sum(_aligned(s.nbytes) for s in self.slots)


def _frozen_view(region: Region) -> Region:
    """``region``'s layout as if fixed, to check a second claim against it."""
    return Region(region.name, region.slots, frozen=True)


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class ArenaLayoutError(RuntimeError):
    """A write that does not fit the layout fixed at the first pass (shape or dtype changed)."""


class Arena:
    """One recompute block's transient mHC state, allocated once per rank.

    Life cycle: ``discovering`` (the first block forward only records slot sizes) ->
    ``allocate()`` (one buffer, regions laid end to end) -> reads and writes at fixed addresses.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.regions: dict[str, Region] = {}
        self.buffer: Tensor | None = None  # reader alias, uint8
        self._writer: Tensor | None = None
        self._region_offsets: dict[str, int] = {}
        self._data_ptrs: dict[tuple[str, int], int] = {}
        # bumped whenever a writer starts (a forward, a recompute, a borrower): a runtime whose
        # forward left its last block's state here finds it kept while the generation is its own
        self.generation = 0

    # -- layout ------------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.buffer is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def region(self, name: str) -> Region:
        if name not in self.regions:
            if self.allocated:
                raise ArenaLayoutError(f"arena region {name!r} was not seen before the arena was "
                                       f"allocated; known regions: {sorted(self.regions)}")
            self.regions[name] = Region(name)
        return self.regions[name]

    def allocate(self) -> None:
        """Fix the layout and allocate the one buffer. Call before any graph capture."""
        if self.allocated:
            return
        offset = 0
        for name, region in self.regions.items():
            self._region_offsets[name] = offset
            for slot in region.slots:
                slot.offset = offset
                offset += _aligned(slot.nbytes)
            region.frozen = True
        self.buffer = static_buffer(torch.zeros(max(offset, ALIGN_BYTES), dtype=torch.uint8,
                                                device=self.device))
        self._writer = own_version_alias(self.buffer)

    def borrow(self, shape: tuple[int, ...] | None = None,
               dtype: torch.dtype = torch.uint8) -> Tensor | None:
        """The arena's first bytes as a ``shape`` tensor of ``dtype`` (through the writer alias;
        no shape: all its bytes), for a temporary that dies before the next forward or recompute;
        None before :meth:`allocate` or if it does not fit.

        Between a block's recompute and the end of its backward the slots hold what that
        backward reads, and inside a forward they pass streams between sublayers; outside those,
        nothing in the arena is read before it is written again (every slot is rewritten before
        it is read). So the end of the backward (the chunk input's gradient) and the optimizer
        step can borrow it instead of allocating."""
        if self._writer is None:
            return None
        self.touch()  # the borrower writes slots
        shape = (self._writer.numel(),) if shape is None else shape
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._writer.numel():
            return None
        return self._writer[:nbytes].view(dtype).view(shape)

    def touch(self) -> int:
        """A writer starts: what the slots held is no longer what anyone left there."""
        self.generation += 1
        return self.generation

    # -- addresses ---------------------------------------------------------------------------
    def contains(self, t: Tensor) -> bool:
        """``t`` is a view of the arena (reader or writer alias: one storage).

        Storage identity, not an address range: every slot tensor is a view of the one storage,
        and on ``meta`` every data pointer is 0, so an address test would claim every tensor.
        """
        return self.buffer is not None and storage_id(t) == storage_id(self.buffer)

    def claim(self, region: Region, index: int, nbytes: int, dtype: torch.dtype) -> Slot:
        """The ``index``-th slot of ``region``: recorded while discovering, checked afterwards."""
        if not region.frozen:
            if index != len(region.slots):
                raise ArenaLayoutError(f"region {region.name}: slots must be claimed in order")
            region.slots.append(Slot(0, nbytes, dtype))
            return region.slots[-1]
        if index >= len(region.slots):
            raise ArenaLayoutError(
                f"region {region.name}: write #{index} but the layout has {len(region.slots)} slots; "
                f"the ops of this sublayer changed since the layout was fixed")
        slot = region.slots[index]
        if slot.nbytes != nbytes or slot.dtype != dtype:
            raise ArenaLayoutError(
                f"region {region.name} slot {index}: layout holds {slot.nbytes} bytes of {slot.dtype}, "
                f"got {nbytes} bytes of {dtype}; shapes must stay fixed under static buffers")
        return slot

    def fixed_slot(self, name: str, nbytes: int, dtype: torch.dtype) -> Slot:
        """The one slot of region ``name``, claimed by the first caller and checked for every
        later one (chunks of a pipeline rank share the arena and claim the same slots)."""
        region = self.region(name)
        if region.slots:
            return self.claim(region if region.frozen else _frozen_view(region), 0, nbytes, dtype)
        return self.claim(region, 0, nbytes, dtype)

    def writer(self, slot: Slot) -> Tensor:
        """A flat typed view of ``slot`` through the writer alias (own version counter)."""
        return self._writer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype)

    def reader(self, slot: Slot) -> Tensor:
        """A flat typed view of ``slot`` for consumers (never written through)."""
        return self.buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype)

    def write(self, region: Region, index: int, slot: Slot, flat: Tensor) -> None:
        """Copy the flat typed ``flat`` into ``slot`` through the writer alias."""
        dst = self._writer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype)
        self.track(region.name, index, dst)
        with regions.region("copy", "arena slots"):
            dst.copy_(flat)

    def track(self, name: str, index: int, t: Tensor) -> None:
        """Record where entry ``index`` of region ``name`` is written; refuse if it moved."""
        key, ptr = (name, index), t.data_ptr()
        if self._data_ptrs.setdefault(key, ptr) != ptr:
            raise ArenaLayoutError(f"region {name} slot {index} moved: "
                                   f"{self._data_ptrs[key]:#x} -> {ptr:#x}")

    def data_ptrs(self) -> dict[tuple[str, int], int]:
        """Every slot's address as first written (for invariance checks)."""
        return dict(self._data_ptrs)
