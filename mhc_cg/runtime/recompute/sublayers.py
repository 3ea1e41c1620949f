"""How a sublayer's mHC ops keep their state on the static buffers: two strategies, one runtime.

:class:`mhc_cg.runtime.recompute.static.StaticRecompute` runs blocks, persistent sets, hooks and
recompute graphs; what a sublayer writes where is one of these. Each call is told the persistent
set it writes (``pset``; ``None`` for a capture that serves several microbatches, whose forward
then copies what the set needs in after it):

* ``FusedSublayers``: mhc_cg's fused sublayers name every buffer (``FusedSlots``): the pre writes
  F's input into its arena slot and the mapping state into the persistent set, F's last Linear
  writes its output into the set, the post writes the next sublayer's input slot. The block
  recompute is one op (:func:`mhc_cg.ops.kernels.recompute_block`).
* ``HookedSublayers``: layers run step by step (foreign layers, Megatron-LM main's among them):
  whatever autograd saves inside the mHC ops is copied into the next slot of the sublayer's arena
  region by ``saved_tensors_hooks``, and autograd keeps a view of the slot. The block input and F's
  output go to the persistent set first, so they are saved from there (never a second copy in the
  arena). The block recompute re-runs the mHC ops under the same hooks, writing the same slots.

Note [recompute without rebuilding autograd] (docs/design.md, item 2). Either way the autograd
graph is the one eager builds: same ops, same order, so gradients are
bit-identical to no recompute.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.core.storage import is_buffer, storage_id
from mhc_cg.model import recomputes_activation, writes_output_into
from mhc_cg.ops.kernels import Target, recompute_block
from mhc_cg.runtime.recompute.arena import Arena
from mhc_cg.runtime.recompute.chunk import ChunkLayout
from mhc_cg.runtime.recompute.fused_slots import FusedSlots
from mhc_cg.runtime.recompute.persistent import PersistentSetPool, PersistentSlotSet
from mhc_cg.runtime.recompute.store import RegionCursor, store_in, store_in_slot

SUBLAYER_NAMES = ("attn", "mlp")


def sublayers_for(layout: ChunkLayout, sets: PersistentSetPool, arena: Arena, seq_length: int,
                  micro_batch_size: int, dtype: torch.dtype):
    """The strategy the chunk's layers need: fused when their sublayers are fused, else hooked."""
    cfg = layout.layers[0].attention.cfg
    if layout.layers[0].attention.fused:
        return FusedSublayers(FusedSlots(arena, layout.block_size, cfg, seq_length,
                                         micro_batch_size, dtype), layout)
    return HookedSublayers(layout, sets, arena)


class FusedSublayers:
    """Fused sublayers on named buffers; see the module docstring."""

    discovers_layout = False  # every slot is named up front

    def __init__(self, slots: FusedSlots, layout: ChunkLayout):
        self.slots, self.layout = slots, layout
        self._links: dict = {}  # set key -> the link of the post whose output that pre reads

    def lay_out(self, seq_length: int, micro_batch_size: int, dtype: torch.dtype) -> None:
        """The activation slots; the fused slots named themselves already."""
        arena, item = self.slots.arena, torch.empty((), dtype=dtype).element_size()
        for i, layer in enumerate(self.layout.layers):
            if recomputes_activation(layer.mlp):
                ffn = layer.mlp.fn.fc1.out_features
                arena.fixed_slot(f"L{i % self.layout.block_size}.mlp.act",
                                 seq_length * micro_batch_size * ffn * item, dtype)

    def pre(self, sub, position: int, k: int, x: Tensor,
            pset: PersistentSlotSet | None) -> tuple[Tensor, tuple]:
        """Past the chunk's first sublayer, the post before wrote this pre's state into the set
        (:meth:`post`): the pre takes it there and reads x once."""
        key = self.layout.key(sub, k)
        state_out = None if pset is None else Target.of(pset.states[key])
        written = pset.states[key] if pset is not None and key != (0, 0) else None
        fn_input, state, x_on = sub.pre(x, self.slots.fn_input(2 * position + k), state_out,
                                        written, self._links.pop(key, None))
        return fn_input, (state, x_on)

    def post(self, sub, position: int, k: int, y: Tensor, carry: tuple, seed: Tensor | None,
             pset: PersistentSlotSet | None, scratch: Tensor | None = None) -> Tensor:
        """The post, and the next sublayer's state into the set, where its pre takes it;
        ``scratch``: where the chunk's output may go (:meth:`_output_target`)."""
        state, x_on = carry
        key = self.layout.key(sub, k)
        if pset is not None and not is_buffer(pset.fn_outputs[key], y):
            y = store_in(y, pset.fn_outputs[key])
        nxt, next_key = self._next_of(key)
        state_out = None if pset is None or nxt is None else Target.of(pset.states[next_key])
        target = self._output_target(sub, position, k, pset, x_on, scratch)
        out = sub.post(x_on, state, y, seed, target, nxt=nxt, state_out=state_out)
        # the next sublayer's F output, dead once its pre's backward has read it, carries this
        # post's F output gradient from that backward (another graph) to this one's; at the
        # chunk's end the post links the pre it feeds in another chunk, which no slot here reaches
        link = sub.handed_link(out) if pset is not None and nxt is not None else None
        if link is not None:
            link.g_y_out = pset.fn_outputs[next_key]
            self._links[next_key] = link
        return out

    def _next_of(self, key: tuple[int, int]) -> tuple:
        """``(sublayer, set key)`` after the sublayer at set key ``key`` in the chunk;
        ``(None, None)`` at its end."""
        i, k = key
        layers = self.layout.layers
        if k == 0:
            return layers[i].mlp, (i, 1)
        if i + 1 < len(layers):
            return layers[i + 1].attention, (i + 1, 0)
        return None, None

    def fn_output_buffer(self, sub, k: int, pset: PersistentSlotSet | None) -> Tensor | None:
        """Where F's last Linear writes its output: the set's buffer (no copy after F), for an
        F that writes into a buffer it is given (a MoE's output is copied in by the post)."""
        if pset is None or not writes_output_into(sub.fn):
            return None
        return pset.fn_outputs[self.layout.key(sub, k)]

    def kept_fn_output(self, sub, k: int, y: Tensor, pset: PersistentSlotSet | None) -> Tensor:
        """F's output as the persistent set keeps it, where the post put it there."""
        return y if pset is None else pset.fn_outputs[self.layout.key(sub, k)]

    def state(self, carry: tuple) -> Tensor:
        return carry[0]

    def recompute_block(self, block: int, pset) -> None:
        """The block's chain in one op, from the set into the arena slots."""
        subs = [sub for layer in self.layout.blocks[block] for sub in (layer.attention, layer.mlp)]
        hc = subs[0].hc
        with torch.no_grad():
            params = torch.stack([torch.cat([s.hc.bias, s.hc.alpha_pre, s.hc.alpha_post,
                                             s.hc.alpha_res]) for s in subs])
            norms = torch.stack([s.norm.weight for s in subs])
            x_out, fn_input_out = self.slots.recompute_outputs(len(subs))
            recompute_block(pset.block_inputs[block], pset.block_fn_outputs[block],
                            pset.block_states[block], params, norms, pset.seed,
                            subs[0].dropout_p, [s.dropout_stream for s in subs], hc.num_streams,
                            hc.sinkhorn_iterations, subs[0].norm.eps, x_out, fn_input_out,
                            hc.kernels, h_res_transposed=hc.h_res_transposed)

    def _output_target(self, sub, position: int, k: int, pset, x_on: Tensor,
                       scratch: Tensor | None) -> Target | None:
        """The next sublayer's input slot; for a block's last, the next block's input (in the
        set); for the chunk's output, the ``scratch`` of the graph capturing it, if given
        (Note [forward scratch]: its reader takes it before the next replay), else ``None``."""
        layout = self.layout
        block, j = layout.index(sub) // layout.block_size, 2 * position + k
        if j + 1 < 2 * len(layout.blocks[block]):
            return self.slots.stream(j + 1)
        if block + 1 < len(layout.blocks) and pset is not None:
            return Target.of(pset.block_inputs[block + 1])
        if scratch is not None and scratch.dtype == x_on.dtype and scratch.numel() >= x_on.numel():
            return Target.of(scratch[:x_on.numel()].view(x_on.shape))
        return None


class HookedSublayers:
    """Sublayers saved through ``saved_tensors_hooks``; see the module docstring."""

    discovers_layout = True  # the runtime runs the first block once for the slots' sizes

    def __init__(self, layout: ChunkLayout, sets: PersistentSetPool, arena: Arena):
        self.layout, self.sets, self.arena = layout, sets, arena
        self._cursor: RegionCursor | None = None
        self._persistent: set[int] = set()  # storages of every set's block inputs and F outputs

    def lay_out(self, seq_length: int, micro_batch_size: int, dtype: torch.dtype) -> None:
        """What the hooks save in place: every set's block inputs and F outputs."""
        self._persistent = {storage_id(t) for pset in self.sets.all_sets()
                            for t in (*pset.block_inputs, *pset.fn_outputs.values())}

    # -- the hooks ---------------------------------------------------------------------------
    def _pack(self, t: Tensor) -> Tensor:
        key = storage_id(t)
        if self.arena.contains(t) or key in self.layout.param_storages or key in self._persistent:
            return t
        return self._cursor.save(t)

    @contextlib.contextmanager
    def region(self, position: int, sublayer: int, segment: int) -> Iterator[None]:
        """Everything autograd saves in here goes to arena region (position, sublayer, segment)."""
        name = f"L{position}.{SUBLAYER_NAMES[sublayer]}.{segment}"
        previous = self._cursor
        self._cursor = RegionCursor(self.arena, self.arena.region(name))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self._cursor = previous

    # -- one sublayer ------------------------------------------------------------------------
    def pre(self, sub, position: int, k: int, x: Tensor,
            pset: PersistentSlotSet | None) -> tuple[Tensor, tuple]:
        """Region segment 0; the carry is ``(h_post, mixed)``.

        ``h_res`` is applied here, before F, so that a graph which ends inside F (MoE partial
        capture) holds every consumer of ``x``; the gradient of ``x`` is then summed in the same
        order as in ``MHCSublayer.forward`` (consumers run backward in reverse creation order, and
        h_res stays the last consumer of ``x`` created).
        """
        if position == 0 and k == 0 and storage_id(x) not in self._persistent:
            # x_l0 to its set first (the runtime's forward put it there already; a graph's
            # capture of the sublayer alone did not): the block's mHC ops save it from there,
            # and the recompute reads it there
            x = store_in(x, required_set(pset, "the block input").block_inputs[
                self.layout.index(sub) // self.layout.block_size])
        with self.region(position, k, 0):
            h_pre, h_post, h_res = sub.mappings(x)
            normed = store_in_slot(sub.norm(sub.aggregate(x, h_pre)), self._cursor)
            mixed = sub.h_res_step(h_res, x)
        return normed, (h_post, mixed)

    def post(self, sub, position: int, k: int, y: Tensor, carry: tuple, seed: Tensor | None,
             pset: PersistentSlotSet | None, scratch: Tensor | None = None) -> Tensor:
        """Region segment 1: ``mixed + dropout(h_post * y)``, ``y`` first to its set, so that
        the forward and the recompute (which reads it there) save the same tensor. The output
        goes where autograd puts it (``scratch`` is not taken)."""
        h_post, mixed = carry
        if storage_id(y) not in self._persistent:
            y = store_in(y, required_set(pset, "F's output").fn_outputs[self.layout.key(sub, k)])
        with self.region(position, k, 1):
            return sub.post_bda(y, h_post, mixed, seed)

    def fn_output_buffer(self, sub, k: int, pset: PersistentSlotSet | None) -> None:
        return None  # F writes where it likes; the post stores its output

    def kept_fn_output(self, sub, k: int, y: Tensor, pset: PersistentSlotSet | None) -> Tensor:
        return y

    def state(self, carry: tuple) -> None:
        return None

    def recompute_block(self, block: int, pset) -> None:
        """Re-run block ``block``'s mHC ops from ``pset`` into the arena (no F, nothing returned).

        Grad mode is on so that autograd saves, and the hooks store, exactly what the forward
        stored; the autograd graph built here is dropped on return.
        """
        with torch.enable_grad():
            x = pset.block_inputs[block].detach().requires_grad_()
            first = block * self.layout.block_size
            for position, layer in enumerate(self.layout.blocks[block]):
                for k, sub in enumerate((layer.attention, layer.mlp)):
                    y = pset.fn_outputs[(first + position, k)].detach().requires_grad_()
                    # Drop each temporary at its last use: what reads it saved it into slots,
                    # and the graph's pool then holds at most two of the n-stream tensors at once.
                    pre = self.pre(sub, position, k, x, pset)
                    x = None
                    x = self.post(sub, position, k, y, pre[1], pset.seed, pset)
                    pre = None


def _unpack(t: Tensor) -> Tensor:
    return t


def required_set(pset: PersistentSlotSet | None, what: str) -> PersistentSlotSet:
    """``pset``, for a hooked sublayer's write that cannot be deferred to the forward."""
    if pset is None:
        raise StaticRecomputeError(
            f"a hooked sublayer ({what}) ran outside a forward with several persistent sets and "
            f"no set named: a graph captured here would write one set for every microbatch; "
            f"capture it for its microbatch's set, or with capacity 1")
    return pset
