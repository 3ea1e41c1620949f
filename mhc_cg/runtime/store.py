"""Writing tensors into static buffers so that autograd saves the buffer, not the tensor.

* ``RegionCursor`` fills one arena region slot by slot (tensors sharing a storage share a slot);
* ``store_in_slot`` / ``store_in`` are one identity autograd Function whose output is the static
  buffer (an arena slot, a persistent-set buffer) the input was written into: consumers that save
  their input then save the buffer, and the original tensor can be freed at once.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from mhc_cg.core.storage import alias, storage_id
from mhc_cg.runtime.arena import Arena, Region
from mhc_cg.core import regions


class RegionCursor:
    """Fills one arena region in order; dedupes tensors that share a storage."""

    def __init__(self, arena: Arena, region: Region):
        self.arena, self.region = arena, region
        self.index = 0
        self.seen: dict[tuple[int, torch.dtype], Tensor | None] = {}
        # Weak references to the originals' storages keep their ids (the dedupe keys) from being
        # given to a later storage of the region, without keeping their memory allocated.
        self.storage_refs: list[StorageWeakRef] = []

    def save(self, t: Tensor) -> Tensor:
        """Store ``t``'s whole storage in the next slot; return a slot view with ``t``'s geometry."""
        storage = t.untyped_storage()
        key = (storage_id(t), t.dtype)
        if key not in self.seen:
            itemsize = t.element_size()
            nbytes = storage.nbytes() // itemsize * itemsize
            slot = self.arena.claim(self.region, self.index, nbytes, t.dtype)
            if self.arena.allocated:
                flat = t.as_strided((nbytes // itemsize,), (1,), 0)
                self.arena.write(self.region, self.index, slot, flat)
                self.seen[key] = self.arena.reader(slot)
            else:
                self.seen[key] = None  # discovering: the original stands in for its slot
            self.storage_refs.append(StorageWeakRef(storage))
            self.index += 1
        flat = self.seen[key]
        if flat is None:
            return t
        # as_strided's offset counts from the start of the arena's storage, not of the slot
        return flat.as_strided(t.size(), t.stride(), flat.storage_offset() + t.storage_offset())


class _StoreTo(torch.autograd.Function):
    """Identity whose output is the static buffer ``write(t)`` put ``t`` into.

    ``write`` is a non-tensor argument, so the output is no autograd view of an input: it is the
    buffer's own alias, and what saves it saves the buffer.
    """

    @staticmethod
    def forward(ctx, t: Tensor, write: Callable[[Tensor], Tensor]) -> Tensor:
        out = write(t)
        return t.view_as(t) if out is t else out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def store_in_slot(t: Tensor, cursor: RegionCursor) -> Tensor:
    """``t`` as the next slot of ``cursor``'s region (``t`` itself while the layout is discovered)."""
    return _StoreTo.apply(t, lambda t: cursor.save(t.contiguous()))


def store_in(t: Tensor, dst: Tensor) -> Tensor:
    """``t`` written into the persistent buffer ``dst``, as ``dst``."""
    def write(t: Tensor) -> Tensor:
        with regions.region("copy", "persistent set"):
            dst.copy_(t)  # nothing saved a view of dst since its set was acquired: no version clash
        return alias(dst)

    return _StoreTo.apply(t, write)
