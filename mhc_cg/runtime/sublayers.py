"""How a sublayer's mHC ops keep their state on the static buffers: two strategies, one runtime.

:class:`mhc_cg.runtime.static.StaticRecompute` runs blocks, persistent sets, hooks and
recompute graphs; what a sublayer writes where is one of these. Each call takes the sublayer's
record (:class:`~mhc_cg.runtime.chunk.SublayerRecord`: where it stands) and the
microbatch's frame (:class:`~mhc_cg.runtime.frame.Frame`: the persistent set it writes,
``None`` for a capture that serves several microbatches, whose forward then copies what the set
needs in after it; the seed; what the post before handed on):

* ``FusedSublayers``: mhc_cg's fused sublayers name every buffer (``FusedSlots``): the pre writes
  F's input into its arena slot and the mapping state into the persistent set, F's last Linear
  writes its output into the set, the post writes the next sublayer's input slot and that
  sublayer's state. The block recompute is one op (:func:`mhc_cg.ops.kernels.recompute_block`).
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
from mhc_cg.model import writes_output_into
from mhc_cg.ops.kernels import Target, recompute_block
from mhc_cg.runtime.arena import Arena
from mhc_cg.runtime.chunk import ChunkLayout, SublayerRecord
from mhc_cg.runtime.frame import Frame
from mhc_cg.runtime.fused_slots import FusedSlots
from mhc_cg.runtime.persistent import PersistentSetPool, PersistentSlotSet
from mhc_cg.runtime.store import RegionCursor, store_in, store_in_slot


def sublayers_for(layout: ChunkLayout, sets: PersistentSetPool, arena: Arena, seq_length: int,
                  micro_batch_size: int, dtype: torch.dtype):
    """The strategy the chunk's layers need: fused when their sublayers are fused, else hooked."""
    if layout.records[0].sub.fused:
        return FusedSublayers(FusedSlots(arena, layout.block_sublayers, layout.cfg, seq_length,
                                         micro_batch_size, dtype), layout)
    return HookedSublayers(layout, sets, arena)


class FusedSublayers:
    """Fused sublayers on named buffers; see the module docstring."""

    discovers_layout = False  # every slot is named up front

    def __init__(self, slots: FusedSlots, layout: ChunkLayout):
        self.slots, self.layout = slots, layout

    def lay_out(self, seq_length: int, micro_batch_size: int, dtype: torch.dtype) -> None:
        """The activation slots; the fused slots named themselves already."""
        arena, item = self.slots.arena, torch.empty((), dtype=dtype).element_size()
        for record in self.layout.records:
            if record.recompute_activation:
                ffn = record.sub.fn.fc1.out_features
                arena.fixed_slot(record.activation_region,
                                 seq_length * micro_batch_size * ffn * item, dtype)

    def pre(self, record: SublayerRecord, x: Tensor, frame: Frame,
            grad_owned: bool = False) -> tuple[Tensor, tuple]:
        """Past the chunk's first sublayer, the post before wrote this pre's state into the set
        (:meth:`post`), or handed it on where there is no set: the pre reads x once.
        ``grad_owned``: ``x_on`` leaves the graph that captures this pre (a MoE head's)."""
        pset, handoff = frame.pset, frame.take(record.order)
        fn_input_out = self.slots.fn_input(record)
        if pset is None:
            fn_input, state, x_on = record.sub.pre(x, fn_input_out, handoff=handoff,
                                                   grad_owned=grad_owned)
        else:
            written = pset.states[record.key] if record.order != 0 else None
            fn_input, state, x_on = record.sub.pre(
                x, fn_input_out, Target.of(pset.states[record.key]), written,
                handoff.link if handoff is not None else None, grad_owned=grad_owned)
        return fn_input, (state, x_on)

    def post(self, record: SublayerRecord, y: Tensor, carry: tuple, frame: Frame,
             scratch: Tensor | None = None, grad_owned: bool = False) -> Tensor:
        """The post, and the next sublayer's state into the set, where its pre takes it (the
        link it hands that pre through ``frame``); ``scratch``: where the chunk's output may go
        (:meth:`_output_target`); ``grad_owned``: the output's gradient comes in a graph's own
        buffer."""
        state, x_on = carry
        pset, nxt = frame.pset, self.layout.after(record)
        if pset is not None and not is_buffer(pset.fn_outputs[record.key], y):
            y = store_in(y, pset.fn_outputs[record.key])
        target = self._output_target(record, nxt, pset, x_on, scratch)
        if nxt is None:
            return record.sub.post(x_on, state, y, frame.seed, target, grad_owned=grad_owned)
        state_out = None if pset is None else Target.of(pset.states[nxt.key])
        out, handoff = record.sub.post_feeding(nxt.sub, x_on, state, y, frame.seed, target,
                                               state_out, grad_owned=grad_owned)
        if handoff is not None and handoff.link is not None and pset is not None:
            # the next sublayer's F output, dead once its pre's backward has read it, carries
            # this post's F output gradient from that backward (another graph) to this one's
            handoff.link.g_y_out = pset.fn_outputs[nxt.key]
        frame.hand(nxt.order, handoff)
        return out

    def fn_output_buffer(self, record: SublayerRecord, pset: PersistentSlotSet | None
                         ) -> Tensor | None:
        """Where F's last Linear writes its output: the set's buffer (no copy after F), for an
        F that writes into a buffer it is given (a MoE's output is copied in by the post)."""
        if pset is None or not writes_output_into(record.sub.fn):
            return None
        return pset.fn_outputs[record.key]

    def kept_fn_output(self, record: SublayerRecord, y: Tensor,
                       pset: PersistentSlotSet | None) -> Tensor:
        """F's output as the persistent set keeps it, where the post put it there."""
        return y if pset is None else pset.fn_outputs[record.key]

    def state(self, carry: tuple) -> Tensor:
        return carry[0]

    def recompute_block(self, block: int, pset: PersistentSlotSet) -> None:
        """The block's chain in one op, from the set into the arena slots."""
        records = self.layout.blocks[block]
        subs = [record.sub for record in records]
        hc = subs[0].hc
        with torch.no_grad():
            params = torch.stack([torch.cat([s.hc.bias, s.hc.alpha_pre, s.hc.alpha_post,
                                             s.hc.alpha_res]) for s in subs])
            # no norm weight: F normalises its input itself (TE's norm fused into its linear)
            norms = (None if subs[0].norm.weight is None
                     else torch.stack([s.norm.weight for s in subs]))
            x_out, fn_input_out = self.slots.recompute_outputs(len(subs))
            recompute_block(pset.block_inputs[block], pset.block_fn_outputs[block],
                            pset.block_states[block], params, norms, pset.seed,
                            subs[0].dropout_p, [record.dropout_stream for record in records],
                            hc.num_streams, hc.sinkhorn_iterations, subs[0].norm.eps, x_out,
                            fn_input_out, hc.kernels, h_res_transposed=hc.h_res_transposed,
                            arithmetic=hc.arithmetic)

    def _output_target(self, record: SublayerRecord, nxt: SublayerRecord | None, pset,
                       x_on: Tensor, scratch: Tensor | None) -> Target | None:
        """The next sublayer's input slot; for a block's last, the next block's input (in the
        set); for the chunk's output, the ``scratch`` of the graph capturing it, if given
        (Note [forward scratch]: its reader takes it before the next replay), else ``None``."""
        if nxt is not None and nxt.block == record.block:
            return self.slots.stream(nxt)
        if nxt is not None:
            return Target.of(pset.block_inputs[nxt.block]) if pset is not None else None
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
    def region(self, record: SublayerRecord, segment: int) -> Iterator[None]:
        """Everything autograd saves in here goes to ``record``'s arena region of ``segment``."""
        previous = self._cursor
        self._cursor = RegionCursor(self.arena, self.arena.region(record.regions[segment]))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self._cursor = previous

    # -- one sublayer ------------------------------------------------------------------------
    def pre(self, record: SublayerRecord, x: Tensor, frame: Frame,
            grad_owned: bool = False) -> tuple[Tensor, tuple]:
        """Region segment 0; the carry is ``(h_post, mixed)`` (``grad_owned``: nothing is written
        in place here).

        ``h_res`` is applied here, before F, so that a graph which ends inside F (MoE partial
        capture) holds every consumer of ``x``; the gradient of ``x`` is then summed in the same
        order as in ``MHCSublayer.forward`` (consumers run backward in reverse creation order, and
        h_res stays the last consumer of ``x`` created).
        """
        sub = record.sub
        if record.first_in_block and storage_id(x) not in self._persistent:
            # x_l0 to its set first (the runtime's forward put it there already; a graph's
            # capture of the sublayer alone did not): the block's mHC ops save it from there,
            # and the recompute reads it there
            x = store_in(x, required_set(frame.pset, "the block input").block_inputs[record.block])
        with self.region(record, 0):
            h_pre, h_post, h_res = sub.mappings(x)
            normed = store_in_slot(sub.norm(sub.aggregate(x, h_pre)), self._cursor)
            mixed = sub.h_res_step(h_res, x)
        return normed, (h_post, mixed)

    def post(self, record: SublayerRecord, y: Tensor, carry: tuple, frame: Frame,
             scratch: Tensor | None = None, grad_owned: bool = False) -> Tensor:
        """Region segment 1: ``mixed + dropout(h_post * y)``, ``y`` first to its set, so that
        the forward and the recompute (which reads it there) save the same tensor. The output
        goes where autograd puts it (``scratch`` is not taken; nothing is written in place)."""
        h_post, mixed = carry
        if storage_id(y) not in self._persistent:
            y = store_in(y, required_set(frame.pset, "F's output").fn_outputs[record.key])
        with self.region(record, 1):
            return record.sub.post_bda(y, h_post, mixed, frame.seed)

    def fn_output_buffer(self, record: SublayerRecord, pset: PersistentSlotSet | None) -> None:
        return None  # F writes where it likes; the post stores its output

    def kept_fn_output(self, record: SublayerRecord, y: Tensor,
                       pset: PersistentSlotSet | None) -> Tensor:
        return y

    def state(self, carry: tuple) -> None:
        return None

    def recompute_block(self, block: int, pset: PersistentSlotSet) -> None:
        """Re-run block ``block``'s mHC ops from ``pset`` into the arena (no F, nothing returned).

        Grad mode is on so that autograd saves, and the hooks store, exactly what the forward
        stored; the autograd graph built here is dropped on return.
        """
        frame = Frame(pset, pset.seed)
        with torch.enable_grad():
            x = pset.block_inputs[block].detach().requires_grad_()
            for record in self.layout.blocks[block]:
                y = pset.fn_outputs[record.key].detach().requires_grad_()
                # Drop each temporary at its last use: what reads it saved it into slots,
                # and the graph's pool then holds at most two of the n-stream tensors at once.
                pre = self.pre(record, x, frame)
                x = None
                x = self.post(record, y, pre[1], frame)
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
