"""What a sublayer strategy reads of a chunk on the static runtime, handed to it one way.

:class:`~mhc_cg.runtime.recompute.static.StaticRecompute` owns both objects and changes them; the
strategies of :mod:`~mhc_cg.runtime.recompute.sublayers` get them at construction and only read
them (they never hold the runtime):

* :class:`ChunkLayout`: the chunk's layers cut into recompute blocks, each sublayer's persistent
  set key, and the parameters' storages (saved as they are, never copied into slots);
* :class:`SetBinding`: which persistent set a sublayer writes now, and whether F is running.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.core.storage import storage_id
from mhc_cg.runtime.recompute.persistent import PersistentSetPool, PersistentSlotSet


class ChunkLayout:
    """``layers`` in recompute blocks of ``block_size`` layers (the last may be shorter)."""

    def __init__(self, layers, block_size: int):
        if block_size < 1:
            raise StaticRecomputeError(f"block_size must be >= 1, got {block_size}")
        self.layers = list(layers)
        self.block_size = block_size
        self.blocks = [self.layers[i:i + block_size] for i in range(0, len(self.layers), block_size)]
        self._sub_index = {id(sub): i for i, layer in enumerate(self.layers)
                           for sub in (layer.attention, layer.mlp)}
        # Parameters (and views of them, e.g. a transposed weight) are saved as they are: they do
        # not change between a forward and its backward, so copying them into slots is waste.
        self.param_storages = {storage_id(p) for layer in self.layers for p in layer.parameters()}

    def key(self, sub, k: int) -> tuple[int, int]:
        """``(layer in the chunk, sublayer)``: the persistent set's key."""
        return self._sub_index[id(sub)], k

    def index(self, sub) -> int:
        """The chunk index of the layer ``sub`` belongs to."""
        return self._sub_index[id(sub)]


class SetBinding:
    """The persistent set sublayers write into, and whether F runs (its saved tensors stay)."""

    def __init__(self, sets: PersistentSetPool):
        self.sets = sets
        self.active: PersistentSlotSet | None = None  # the set of the forward in progress
        self.bound: PersistentSlotSet | None = None  # the set a capture writes (capturing_for)
        self.in_fn = False

    def writing_set(self) -> PersistentSlotSet | None:
        """The forward's set; outside a forward, the one a capture was bound to
        (:meth:`capturing_for`), else the pool's fixed set; ``None`` when several sets could be
        meant (the forward then copies what the set needs in after the sublayer)."""
        if self.active is not None:
            return self.active
        return self.bound if self.bound is not None else self.sets.fixed_set()

    def required_set(self, what: str) -> PersistentSlotSet:
        """:meth:`writing_set`, for a write that cannot be deferred to the forward."""
        pset = self.writing_set()
        if pset is None:
            raise StaticRecomputeError(
                f"{what} ran outside a forward with {self.sets.capacity} persistent sets: a graph "
                f"captured here would write one set for every microbatch; bind the capture to its "
                f"microbatch's set (StaticRecompute.capturing_for), or capture with capacity 1")
        return pset

    @contextlib.contextmanager
    def capturing_for(self, pset: PersistentSlotSet) -> Iterator[None]:
        """Sublayers run in here (a graph's capture for one microbatch) write ``pset``."""
        previous, self.bound = self.bound, pset
        try:
            yield
        finally:
            self.bound = previous

    @contextlib.contextmanager
    def fn_region(self) -> Iterator[None]:
        """F's own activations are kept by autograd as usual (F is not recomputed)."""
        self.in_fn = True
        try:
            yield
        finally:
            self.in_fn = False
