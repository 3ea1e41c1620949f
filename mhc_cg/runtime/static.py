"""Static-buffer mHC recompute: forward, discard and recompute on fixed addresses.

How it works, per sublayer of a recompute block (docs/design.md, invariants 1-4):

* The sublayer's mHC ops keep what their backward reads in arena slots, so the forward frees
  its temporaries at once; how (named buffers, or saved-tensor hooks) is the sublayer strategy's
  business (:mod:`mhc_cg.runtime.sublayers`). F (attention, MLP) is not recomputed: its
  own saved tensors are kept as usual, its input lives in a slot.
* Per microbatch, a persistent slot set keeps only x_l0 of each block, each F output and the dropout
  seed. The block recompute is then a pure function of those: it re-runs the block's mHC ops (not
  F) with the same hooks, writing the same values into the same slots. It has static inputs and
  outputs, so a graph backend can capture it once per (block, persistent set) and replay it.
* A hook on the gradient of the block output runs (or replays) the recompute; the block's first
  backward node runs only after that gradient exists. The chunk's last block is the exception
  when its backward directly follows its forward: the arena still holds what that forward wrote,
  the recompute's very bits, and nothing runs (the runtime notes the arena's generation when its
  forward ends; every forward, recompute and borrower of the arena starts a new one, so a stale
  arena is always recomputed).
* Activation recompute for an MLP that asks for it keeps fc1's output in the set and the gelu
  output in the arena (:mod:`mhc_cg.runtime.activation`).

The parts, each one job: the chunk's records (:mod:`~mhc_cg.runtime.chunk`), one
microbatch's frame (:mod:`~mhc_cg.runtime.frame`), one sublayer's path on the buffers
(:mod:`~mhc_cg.runtime.sublayer_path`, over a strategy of
:mod:`~mhc_cg.runtime.sublayers`), the block recompute
(:mod:`~mhc_cg.runtime.block_function`); :class:`StaticRecompute` is the chunk's
forward over them and its backward: the hooks that run (or replay, or skip) a block's recompute,
and what a forward leaves pending.

Invariants the tests check: slot addresses never move, nothing is resized or re-pointed after
``prepare``, and the arena does not grow with the number of microbatches.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from mhc_cg.ops.dropout import stateful_dropout_problem
from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.core.regions import region
from mhc_cg.core.storage import is_buffer
from mhc_cg.model import MHCTransformerLayer, run_chain
from mhc_cg.graphs.static_inputs import check_input
from mhc_cg.runtime.activation import ActivationSlots
from mhc_cg.runtime.arena import Arena
from mhc_cg.runtime.block_function import BlockRecompute
from mhc_cg.runtime.chunk import ChunkLayout, SublayerRecord
from mhc_cg.runtime.frame import Frame
from mhc_cg.runtime.persistent import (PersistentSetPool, PersistentSlotSet,
                                                 new_persistent_set)
from mhc_cg.runtime.store import store_in
from mhc_cg.runtime.sublayer_path import SublayerPath
from mhc_cg.runtime.sublayers import sublayers_for


@dataclass(frozen=True)
class SublayerGraph:
    """What runs a sublayer instead of the eager path: its graphed callable
    ``fn(x, seed) -> (out, F output, state)``; with ``moe_step`` (``route`` / ``preprocess``) the
    graph is a MoE sublayer's head, and ``tail(record, head outputs, frame)`` runs the rest from
    its outputs (:func:`mhc_cg.runtime.graphable.moe_tail`). ``named``: the replay runs
    in the sublayer's ``fwd`` range, as the graphed modes name it. ``writes_set``: it was
    captured writing the one persistent set every forward takes, so its F output and state are
    the set's already; without it (a graph serving several microbatches) the forward copies them
    into its own set."""

    fn: Callable
    moe_step: str | None = None
    named: bool = True
    tail: Callable | None = None
    writes_set: bool = False


# what a sublayer runs as instead of the eager path: a SublayerGraph, or a callable alone
# ``fn(x, frame) -> (out, F output, state)``, by the record's ``order``
SublayerFns = Mapping[int, "SublayerGraph | Callable"]


class StaticRecompute:
    """The static-buffer runtime for the layers of one model chunk.

    ``layout`` cuts the chunk's layers into recompute blocks, a record per sublayer. ``arena``
    and the persistent set pool may be shared by several chunks of one pipeline rank (they have
    the same block shape). ``path`` runs one sublayer on the buffers; ``recompute(block, set)``
    is a block's recompute, ``recompute_graphs[(block, set)]`` its graphs once captured
    (:mod:`mhc_cg.runtime.recompute_captures`; without one it runs eagerly).

    ``trace`` holds the last recomputes run, in order (for tests and debugging): a ring of two
    rounds of every (block, set), so a long run keeps a fixed number; ``recomputes`` counts them
    all, by ``(block, "graph" | "eager" | "kept")``.
    """

    def __init__(self, layout: ChunkLayout, arena: Arena, sets: PersistentSetPool, sublayers):
        cfg = layout.cfg
        problem = stateful_dropout_problem(cfg.dropout_impl, cfg.hidden_dropout,
                                           "dropout_impl", "hidden_dropout")
        if problem is not None:
            raise StaticRecomputeError(f"static-buffer recompute: {problem}")
        self.layout, self.arena, self.sets, self.sublayers = layout, arena, sets, sublayers
        activations = ActivationSlots(arena)
        self.path = SublayerPath(sublayers, activations)
        self.recompute = BlockRecompute(layout, arena, sublayers, activations)
        self.recompute_graphs: dict[tuple[int, int], object] = {}
        # forwards whose backward has not finished: persistent set index -> their frame
        self._pending: dict[int, Frame] = {}
        # (arena generation, block, set) of the state this chunk's last forward left in the
        # arena; the last block's recompute is skipped while the generation is unchanged
        self._kept: tuple[int, int, int] | None = None
        self.trace: deque[str] = deque(maxlen=2 * layout.num_blocks * sets.capacity)
        self.recomputes: Counter[tuple[int, str]] = Counter()

    # -- the chunk forward -----------------------------------------------------------------------
    def forward(self, x: Tensor, seed: Tensor | None,
                sublayer_fns: SublayerFns | None = None) -> Tensor:
        """Run the chunk; returns its output. ``sublayer_fns[record.order]`` runs that sublayer
        instead of the eager path: a :class:`SublayerGraph`, or a callable alone
        ``fn(x, frame) -> (out, F output, state)`` (``frame``: this forward's)."""
        if not self.arena.allocated:
            raise StaticRecomputeError("call prepare() (layout discovery + allocation) before forward")
        if not torch.is_grad_enabled():
            return self.forward_only(x, seed)
        template = self.sets.template
        expected = tuple(template.block_inputs[0].shape)
        if tuple(x.shape) != expected:
            raise StaticRecomputeError(
                f"chunk input has shape {tuple(x.shape)} but the static buffers were laid out for "
                f"{expected} ([seq, micro_batch, n*hidden]); shapes are fixed under static buffers")
        if not x.requires_grad and torch.is_grad_enabled():
            # autograd saves less when the input needs no gradient, and the slot layout was fixed
            # for one that does; a frozen first stage pays one unused input gradient instead
            x = x.detach().requires_grad_()
        if seed is not None:
            check_input("dropout seed", seed, template.seed)
        pset = self.sets.acquire()
        frame = Frame(pset, pset.seed if seed is not None else None)
        self.arena.touch()  # this forward writes the slots
        handles = []
        fns = sublayer_fns or {}
        try:
            if seed is not None:
                with region("copy", "persistent set"):
                    pset.seed.copy_(seed)
            for block, records in enumerate(self.layout.blocks):
                x = _kept_in(x, pset.block_inputs[block])
                for record in records:
                    graph = fns.get(record.order)
                    if graph is None:  # the path writes the set itself
                        x = self.path.run(record, x, frame)[0]
                        continue
                    x, y, mappings = self._graphed(graph, record, x, frame)
                    if not getattr(graph, "writes_set", False):
                        self.path.keep(record, frame, y, mappings)
                if x.requires_grad:
                    handles.append(x.register_hook(self._block_hook(block, frame)))
        except BaseException:
            # Note [an unwound forward leaves nothing behind] (docs/design.md, item 6):
            # anything that unwinds the forward (MoECudaGraphPartialCaptureSignal included) leaves
            # no hook behind and gives the set back: nothing of this microbatch will run backward.
            for handle in handles:
                handle.remove()
            self.sets.release(pset)
            raise
        if handles:
            self._pending[pset.index] = frame
            # its last block's state stays in the slots until something else writes them
            self._kept = (self.arena.generation, self.layout.num_blocks - 1, pset.index)
        else:  # no gradient will flow (e.g. a frozen chunk): nothing will run backward
            self.sets.release(pset)
        return x

    def _graphed(self, graph, record: SublayerRecord, x: Tensor,
                 frame: Frame) -> tuple[Tensor, Tensor, Tensor]:
        """A sublayer through its graph (a :class:`SublayerGraph`, named as the graphed modes
        name it; a MoE head's graph then its eager tail), or a callable alone."""
        if not isinstance(graph, SublayerGraph):  # a callable alone names its own work
            return graph(x, frame)
        if not graph.named:
            return graph.fn(x, frame.seed)
        if graph.moe_step is None:
            with region("fwd", 0, None, f"{record.layer_number}.{record.name}"):
                return graph.fn(x, frame.seed)
        with region("fwd", 0, None, f"{record.layer_number}.moe_head"):
            head = graph.fn(x, frame.seed)
        with region("eager", 0, None, f"{record.layer_number}.moe_tail"):
            return graph.tail(record, head, frame)

    def next_input_buffer(self, shape: tuple[int, ...]) -> Tensor | None:
        """Where the next training forward keeps its chunk input of ``shape`` (block 0's input
        in the set it will take), for the chunk's producer to write it there: the forward then
        copies nothing into the set. ``None`` without grad mode (that forward keeps nothing), a
        free set, or the shape the buffers were laid out for (the forward refuses it)."""
        pset = self.sets.next_set() if torch.is_grad_enabled() else None
        if pset is None or tuple(pset.block_inputs[0].shape) != tuple(shape):
            return None
        return pset.block_inputs[0]

    def forward_only(self, x: Tensor, seed: Tensor | None) -> Tensor:
        """The chunk without a backward to come (evaluation, ``no_grad``): the plain layers,
        eagerly, each post handing the next pre its state. Nothing is saved, so no slot,
        persistent set or graph is touched."""
        return run_chain([r.sub for r in self.layout.records], x, seed)

    # -- the backward ----------------------------------------------------------------------------
    def _block_hook(self, block: int, frame: Frame):
        """The hook on block ``block``'s output gradient: its recompute, before its backward."""
        def hook(grad: Tensor) -> None:
            if frame.released:
                raise StaticRecomputeError(
                    f"backward of a forward that was released (release_pending(), or the next "
                    f"training step): persistent set {frame.pset.index} and the arena may hold "
                    f"another microbatch now; run backward before the next step, or recompute "
                    f"the loss")
            if block in frame.recomputed:
                raise StaticRecomputeError(
                    f"second backward through recompute block {block}: its slots were already "
                    f"consumed and may be overwritten; run backward once per forward")
            frame.recomputed.add(block)
            self.run_recompute(block, frame.pset)
            if block == 0:
                self._pending.pop(frame.pset.index, None)
                self.sets.release(frame.pset)

        return hook

    def run_recompute(self, block: int, pset: PersistentSlotSet) -> None:
        """Block ``block``'s recompute from ``pset`` (its graph where captured), unless the
        arena still holds what that block's forward wrote there: then the slots already hold
        the recompute's bits, and nothing runs.

        Note [recompute graphs] (docs/design.md, item 4): one per (block, persistent set),
        replayed from the hook on the block output's gradient, before the block's first
        backward node; they run one at a time, so no temporary outlives a replay. The chunk's
        last block is skipped when its backward directly follows its forward (every forward,
        recompute and borrower of the arena starts a new arena generation, so a stale arena is
        always recomputed)."""
        kept, self._kept = self._kept == (self.arena.generation, block, pset.index), None
        if kept:
            self.recomputes[(block, "kept")] += 1
            self.trace.append(f"recompute block {block} set {pset.index} (kept from the forward)")
            return
        graph = self.recompute_graphs.get((block, pset.index))
        how = "graph" if graph is not None else "eager"
        self.recomputes[(block, how)] += 1
        self.trace.append(f"recompute block {block} set {pset.index} ({how})")
        # same range name as eager block recompute
        with region("recompute", 0, None, f"block{block}"):
            if graph is not None:
                graph.replay()
            else:
                self.recompute(block, pset)

    @property
    def pending(self) -> int:
        """Forwards whose backward has not finished (their persistent sets are held)."""
        return len(self._pending)

    def release_pending(self) -> int:
        """Give back the persistent set of every forward whose backward never came (an aborted
        step: a non-finite loss, a forward run for its value only); returns how many.

        A backward of a released forward raises instead of reading slots that another
        microbatch may have overwritten.
        """
        released = 0
        self.arena.touch()
        for pset in self.sets.all_sets():
            frame = self._pending.pop(pset.index, None)
            if frame is not None:
                frame.released = True
                self.sets.release(pset)
                released += 1
        return released

    # -- setup -----------------------------------------------------------------------------------
    def discover_layout(self, x: Tensor, seed: Tensor | None) -> None:
        """Run the first block once (layout discovery: slot sizes only, nothing written)."""
        if self.arena.allocated:
            return
        frame = Frame(self.sets.template, seed)  # nothing is written: any set has the layout
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            for record in self.layout.blocks[0]:
                x = self.path.run(record, x, frame)[0]

    def lay_out(self, seq_length: int, micro_batch_size: int, dtype: torch.dtype) -> None:
        """Name every arena slot (the strategy's, or what running the first block once on zeros
        saves), then allocate the arena; a no-op for an arena another chunk laid out."""
        self.sublayers.lay_out(seq_length, micro_batch_size, dtype)
        if self.sublayers.discovers_layout and not self.arena.allocated:
            cfg, device = self.layout.cfg, self.sets.template.seed.device
            x = torch.zeros(seq_length, micro_batch_size, cfg.num_streams * cfg.hidden_size,
                            dtype=dtype, device=device)
            self.discover_layout(x, torch.zeros((), dtype=torch.int64, device=device))
        self.arena.allocate()


def _kept_in(x: Tensor, dst: Tensor) -> Tensor:
    """A block's input ``x`` as the persistent set keeps it (the recompute reads it there, and
    the block's first sublayer saves it from there): ``dst``, written unless ``x`` is it."""
    return x if is_buffer(dst, x) else store_in(x, dst)


def build_static_recompute(layers: list[MHCTransformerLayer], block_size: int, *,
                           seq_length: int, micro_batch_size: int, capacity: int,
                           device: torch.device | str, arena: Arena | None = None,
                           sets: PersistentSetPool | None = None,
                           dtype: torch.dtype = torch.float32) -> StaticRecompute:
    """Lay out and allocate everything static for one chunk: arena (shared if given) and sets.

    ``capacity`` persistent sets (the most microbatches in flight on the rank:
    :func:`mhc_cg.core.pipeline_order.max_persistent_slot_sets` of its order). Pass the same ``arena``
    (and, for chunks of equal depth, the same ``sets``) to every chunk of a rank: both are then
    sized by the rank, not by the number of chunks or microbatches.
    """
    arena = arena if arena is not None else Arena(device)
    if sets is None:
        sets = PersistentSetPool(capacity, lambda i: new_persistent_set(
            i, layers, block_size, seq_length, micro_batch_size, device, dtype))
    layout = ChunkLayout(layers, block_size)
    runtime = StaticRecompute(layout, arena, sets, sublayers_for(
        layout, sets, arena, seq_length, micro_batch_size, dtype))
    runtime.lay_out(seq_length, micro_batch_size, dtype)
    return runtime
