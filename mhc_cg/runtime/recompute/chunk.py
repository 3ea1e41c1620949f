"""What a sublayer strategy reads of a chunk on the static runtime: :class:`ChunkLayout`, the
chunk's layers cut into recompute blocks, each sublayer's persistent set key, and the parameters'
storages (saved as they are, never copied into slots). The runtime and the strategies of
:mod:`~mhc_cg.runtime.recompute.sublayers` get it at construction and only read it; which
persistent set a sublayer writes is an argument of each call."""

from __future__ import annotations

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.core.storage import storage_id


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
