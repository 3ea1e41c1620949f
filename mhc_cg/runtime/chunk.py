"""A model chunk on the static runtime: its layers cut into recompute blocks, every sublayer one
record.

Note [one record per sublayer]: a sublayer's place is named once, by :class:`ChunkLayout`'s
builder, when a mode prepares: its layer (the model's number and its index in the chunk), its
recompute block and position there, attention or MLP, its index in the block (the fused slots'),
its arena regions, its dropout stream and whether its block's recompute runs before its
backward. The runtime, the sublayer strategies, the graphed modes and Megatron's install read
the record; no other code computes a coordinate of a sublayer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.core.storage import storage_id
from mhc_cg.model import MLP

SUBLAYER_NAMES = ("attn", "mlp")


@dataclass(frozen=True, eq=False)
class SublayerRecord:
    """One sublayer of a chunk, every coordinate of it (Note [one record per sublayer]): data
    only, made by :class:`ChunkLayout`'s builder."""

    sub: Any  # the sublayer: a fused MHCSublayer or a stepwise adapter of a foreign layer
    layer_number: int  # its layer's number in the model (what graphs and ranges are named by)
    index: int  # its layer's index in the chunk
    k: int  # 0: attention, 1: MLP
    name: str  # "attn" or "mlp"
    label: str  # "L3.attn": how graphs and profiler ranges name it
    key: tuple[int, int]  # its persistent set entry: (layer index in the chunk, k)
    order: int  # its place in the chunk's stream of sublayers
    block: int  # the chunk's recompute block it is in
    position: int  # its layer's position in that block
    slot: int  # its index among the block's sublayers (the fused slots': stream input, F input)
    first_in_block: bool  # its stream input is the block's input (the persistent set's)
    last_in_block: bool  # its output is the next block's input; its block's recompute runs
    #                      before its backward (the recompute point)
    last_block: bool  # its block is the chunk's last
    last_in_chunk: bool
    regions: tuple[str, str]  # the arena regions a stepwise sublayer's saved tensors fill,
    #                           before F and after (one per position in a block, every block's)
    activation_region: str  # the arena slot of an MLP's gelu output (recompute_activation)
    dropout_stream: int | None  # its counter dropout's stream (the fused sublayer's own)
    recompute_activation: bool  # a dense MLP whose gelu output the runtime keeps in a slot


class ChunkLayout:
    """``layers`` in recompute blocks of ``block_size`` layers (the last may be shorter), and a
    :class:`SublayerRecord` per sublayer: ``records`` in stream order, ``blocks[b]`` block b's.

    A layer names its sublayers in stream order as ``stream_sublayers``, ``(k, sublayer)`` pairs:
    a transformer layer's attention (0) and MLP (1); a hybrid stack's layer its one."""

    def __init__(self, layers, block_size: int):
        if block_size < 1:
            raise StaticRecomputeError(f"block_size must be >= 1, got {block_size}")
        self.layers = list(layers)
        self.block_size = block_size
        self.num_blocks = -(-len(self.layers) // block_size)
        self.records: list[SublayerRecord] = []
        sublayers = [tuple(layer.stream_sublayers) for layer in self.layers]
        for index, layer in enumerate(self.layers):
            block, position = divmod(index, block_size)
            in_block = sum(len(subs) for subs in sublayers[block * block_size:][:block_size])
            before = sum(len(subs) for subs in sublayers[block * block_size:index])
            last_block = block == self.num_blocks - 1
            for j, (k, sub) in enumerate(sublayers[index]):
                name, slot = SUBLAYER_NAMES[k], before + j
                self.records.append(SublayerRecord(
                    sub=sub, layer_number=layer.layer_number, index=index, k=k, name=name,
                    label=f"L{layer.layer_number}.{name}", key=(index, k),
                    order=len(self.records), block=block, position=position, slot=slot,
                    first_in_block=slot == 0, last_in_block=slot == in_block - 1,
                    last_block=last_block, last_in_chunk=last_block and slot == in_block - 1,
                    regions=(f"L{position}.{name}.0", f"L{position}.{name}.1"),
                    activation_region=f"L{position}.mlp.act",
                    dropout_stream=getattr(sub, "dropout_stream", None),
                    recompute_activation=k == 1 and isinstance(sub.fn, MLP)
                    and sub.fn.recompute_activation))
        self.blocks = [[r for r in self.records if r.block == b] for b in range(self.num_blocks)]
        self.block_sublayers = max(len(records) for records in self.blocks)  # the longest's
        self.cfg = self.records[0].sub.cfg  # the stream's shape and dropout: every sublayer's
        # Parameters (and views of them, e.g. a transposed weight) are saved as they are: they do
        # not change between a forward and its backward, so copying them into slots is waste.
        self.param_storages = {storage_id(p) for layer in self.layers for p in layer.parameters()}

    def after(self, record: SublayerRecord) -> SublayerRecord | None:
        """The sublayer after ``record`` in the chunk's stream; ``None`` at its end."""
        following = record.order + 1
        return self.records[following] if following < len(self.records) else None

    def layer_records(self, index: int) -> list[SublayerRecord]:
        """The records of the chunk's layer ``index``, in stream order."""
        return [r for r in self.records if r.index == index]

    def block_layers(self, block: int) -> list:
        """The layers of block ``block``."""
        return [self.layers[index] for index in dict.fromkeys(r.index for r in self.blocks[block])]
