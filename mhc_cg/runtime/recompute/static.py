"""Static-buffer mHC recompute: forward, discard and recompute on fixed addresses.

How it works, per sublayer of a recompute block (docs/design.md, invariants 1-4):

* The sublayer's mHC ops keep what their backward reads in arena slots, so the forward frees
  its temporaries at once; how (named buffers, or saved-tensor hooks) is the sublayer strategy's
  business (:mod:`mhc_cg.runtime.recompute.sublayers`). F (attention, MLP) is not recomputed: its
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
* Activation recompute for an MLP that asks for it: fc1's output goes to the persistent
  set (``fc1_outputs``; the gelu saves a view of it), the gelu output to one arena slot per layer
  position (region ``L{pos}.mlp.act``; fc2 saves a view of it), and the block recompute re-derives
  the gelu output from the persistent fc1 output into that slot. A microbatch then keeps fc1's
  output only, not the activation too; the arena grows by one activation per block position.

Invariants the tests check: slot addresses never move, nothing is resized or re-pointed after
``prepare``, and the arena does not grow with the number of microbatches.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

import torch.nn.functional as F

from mhc_cg.ops.dropout import stateful_dropout_problem
from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.core.regions import region
from mhc_cg.core.storage import is_buffer, storage_id
from mhc_cg.model import MLP, MHCSublayer, MHCTransformerLayer, MoEMLP, recomputes_activation
from mhc_cg.model.moe import MoECudaGraphTensorStore
from mhc_cg.runtime.graphs.static_inputs import check_input
from mhc_cg.runtime.recompute.arena import Arena
from mhc_cg.runtime.recompute.chunk import ChunkLayout
from mhc_cg.runtime.recompute.persistent import PersistentSetPool, PersistentSlotSet, new_persistent_set
from mhc_cg.runtime.recompute.store import RegionCursor, store_in, store_in_slot
from mhc_cg.runtime.recompute.sublayers import SUBLAYER_NAMES, required_set, sublayers_for


@dataclass(frozen=True)
class SublayerGraph:
    """What runs sublayer ``(layer number, k)`` instead of the eager one: its graphed callable
    ``fn(x, seed) -> (out, F output, state)``; with ``moe_step`` (``route`` / ``preprocess``) the
    graph is a MoE sublayer's head, and the runtime runs the rest from its outputs
    (:meth:`StaticRecompute.moe_tail`). ``named``: the replay runs in the sublayer's ``fwd``
    range, as the graphed modes name it."""

    fn: Callable
    moe_step: str | None = None
    named: bool = True


class StaticRecompute:
    """The static-buffer runtime for the layers of one model chunk.

    ``layout`` cuts the chunk's layers into recompute blocks. ``arena`` and the persistent set
    pool may be shared by several chunks of one pipeline rank (they have the same block shape).
    ``sublayers`` is the strategy of :mod:`mhc_cg.runtime.recompute.sublayers` for these layers:
    it reads the layout and is told, call by call, which persistent set a sublayer writes
    (``pset``: the forward's, or the one a graph's capture writes; ``None`` where a capture
    serves several microbatches, and the forward copies what the set needs in after it).

    ``recompute_graphs[(block, set)]`` replay a block's recompute where they were captured
    (:mod:`mhc_cg.runtime.recompute.recompute_captures` makes them); without one the recompute
    runs eagerly.
    """

    def __init__(self, layout: ChunkLayout, arena: Arena, sets: PersistentSetPool, sublayers):
        cfg = layout.layers[0].attention.cfg
        problem = stateful_dropout_problem(cfg.dropout_impl, cfg.hidden_dropout,
                                           "dropout_impl", "hidden_dropout")
        if problem is not None:
            raise StaticRecomputeError(f"static-buffer recompute: {problem}")
        self.layout, self.arena, self.sets, self.sublayers = layout, arena, sets, sublayers
        self.recompute_graphs: dict[tuple[int, int], object] = {}
        # (arena generation, block, set) of the state this runtime's last forward left in the
        # arena; the last block's recompute is skipped while the generation is unchanged
        self._kept: tuple[int, int, int] | None = None
        # The last recomputes run, in order (for tests and debugging): a ring of two rounds of
        # every (block, set), so a long run keeps a fixed number; ``recomputes`` counts them all.
        self.trace: deque[str] = deque(maxlen=2 * len(layout.blocks) * sets.capacity)
        self.recomputes: Counter[tuple[int, str]] = Counter()  # (block, "graph" | "eager") -> runs
        # forwards whose backward has not finished: persistent set index -> its hooks' state
        self._pending: dict[int, dict] = {}

    # -- one sublayer ------------------------------------------------------------------------
    def sublayer(self, sub: MHCSublayer, position: int, k: int, x: Tensor, seed: Tensor | None,
                 pset: PersistentSlotSet | None, scratch: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``MHCSublayer.forward`` on the static buffers, writing ``pset``; returns (output, F
        output, mapping state or None for hooked sublayers). ``scratch``: where the chunk's
        output may go (Note [forward scratch]), for the chunk's last sublayer.

        Two halves around F (``self.sublayers.pre``, :meth:`sublayer_post`), because a graph may
        end between them (MoE partial capture) and the eager remainder must find its buffers
        without the Python state of the captured part.
        """
        fn_input, carry = self.sublayers.pre(sub, position, k, x, pset)
        out = self.sublayers.fn_output_buffer(sub, k, pset)
        if k == 1 and recomputes_activation(sub):
            y = self.mlp_with_activation_recompute(
                sub.fn, position, self.layout.index(sub), fn_input,
                required_set(pset, "an MLP with activation recompute: fc1's output"), out)
        elif out is not None:
            y = sub.fn(fn_input, out)
        else:
            y = sub.fn(fn_input)
        return self.sublayer_post(sub, position, k, y, carry, seed, pset, scratch)

    def sublayer_post(self, sub: MHCSublayer, position: int, k: int, y: Tensor, carry: tuple,
                      seed: Tensor | None, pset: PersistentSlotSet | None,
                      scratch: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """The mHC ops after F (``carry`` what ``self.sublayers.pre`` returned): ``(output, F
        output as the persistent set keeps it, mapping state or None)``."""
        out = self.sublayers.post(sub, position, k, y, carry, seed, pset, scratch)
        return out, self.sublayers.kept_fn_output(sub, k, y, pset), self.sublayers.state(carry)

    def _keep(self, pset: PersistentSlotSet, key: tuple[int, int], y: Tensor,
              state: Tensor | None) -> None:
        """What the recompute reads: F's output (and a fused sublayer's state) into the set,
        unless the sublayer wrote it there."""
        for dst, t in ((pset.fn_outputs[key], y), (pset.states.get(key), state)):
            if dst is None or t is None:
                continue
            if storage_id(dst) != storage_id(t) or dst.storage_offset() != t.storage_offset():
                with region("copy", "persistent set"):
                    dst.copy_(t.detach())

    # -- activation recompute ---------------------------------------------------------------
    def _activation_cursor(self, position: int) -> RegionCursor:
        return RegionCursor(self.arena, self.arena.region(f"L{position}.mlp.act"))

    def mlp_with_activation_recompute(self, mlp: MLP, position: int, index: int, normed: Tensor,
                                      pset: PersistentSlotSet, out: Tensor | None) -> Tensor:
        """``mlp(normed)`` (fc1 -> gelu -> fc2, fc2 into ``out`` where given) with fc1's output
        in ``pset.fc1_outputs[index]`` and the gelu output in the arena slot of ``position``: a
        microbatch keeps neither the activation nor a second copy of fc1's output;
        :meth:`recompute_block` refills the slot."""
        if index not in pset.fc1_outputs:
            raise StaticRecomputeError(
                f"persistent set {pset.index} has no fc1 output slot for chunk layer {index} "
                f"(it has {sorted(pset.fc1_outputs)}); build the sets from a chunk whose layers "
                f"recompute their activation at least where this chunk's do")
        pre = store_in(mlp.fc1(normed), pset.fc1_outputs[index])
        act = F.gelu(pre)  # saves ``pre``: a view of the persistent slot
        act = store_in_slot(act, self._activation_cursor(position))
        return mlp.fc2(act, out)  # saves ``act``: a view of the arena slot

    # -- the block recompute ---------------------------------------------------------------------
    def recompute_block(self, block: int, pset: PersistentSlotSet) -> None:
        """Re-run block ``block``'s mHC ops from ``pset`` into the arena (no F, nothing returned),
        and the gelu output of each of its MLPs that recomputes its activation."""
        self.arena.touch()
        self._kept = None
        self.sublayers.recompute_block(block, pset)
        for position, layer in enumerate(self.layout.blocks[block]):
            if recomputes_activation(layer.mlp):
                self.recompute_activation_slot(
                    position, pset.fc1_outputs[block * self.layout.block_size + position])

    def recompute_activation_slot(self, position: int, pre: Tensor) -> None:
        """Write ``gelu(pre)`` into the activation slot of ``position``."""
        with torch.no_grad():
            self._activation_cursor(position).save(F.gelu(pre))

    def run_recompute(self, block: int, pset: PersistentSlotSet) -> None:
        """Block ``block``'s recompute from ``pset`` (its graph where captured), unless the
        arena still holds what that block's forward wrote there: then the slots already hold
        the recompute's bits, and nothing runs.

        Note [recompute graphs] (docs/design.md, item 4): one per (block, persistent set),
        replayed from the hook on the block output's gradient, before the block's first
        backward node; they run one at a time, so no temporary outlives a replay."""
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
                self.recompute_block(block, pset)

    # -- the chunk forward -----------------------------------------------------------------------
    def forward(self, x: Tensor, seed: Tensor | None,
                sublayer_fns: dict[tuple[int, int], SublayerGraph] | None = None) -> Tensor:
        """Run the chunk; returns its output. ``sublayer_fns[(layer number, k)]`` runs that
        sublayer instead of the eager one: a :class:`SublayerGraph`, or a callable alone
        ``fn(x, seed, pset) -> (out, F output, state)`` (``pset``: the forward's persistent
        set)."""
        if not self.arena.allocated:
            raise StaticRecomputeError("call prepare() (layout discovery + allocation) before forward")
        if not torch.is_grad_enabled():
            return self.forward_only(x, seed)
        expected = tuple(self.sets.all_sets()[0].block_inputs[0].shape)
        if tuple(x.shape) != expected:
            raise StaticRecomputeError(
                f"chunk input has shape {tuple(x.shape)} but the static buffers were laid out for "
                f"{expected} ([seq, micro_batch, n*hidden]); shapes are fixed under static buffers")
        if not x.requires_grad and torch.is_grad_enabled():
            # autograd saves less when the input needs no gradient, and the slot layout was fixed
            # for one that does; a frozen first stage pays one unused input gradient instead
            x = x.detach().requires_grad_()
        if seed is not None:
            check_input("dropout seed", seed, self.sets.all_sets()[0].seed)
        pset = self.sets.acquire()
        self.arena.touch()  # this forward writes the slots
        handles = []
        state = {"released": False}
        try:
            if seed is not None:
                with region("copy", "persistent set"):
                    pset.seed.copy_(seed)
            seed_in = pset.seed if seed is not None else None
            for b, block in enumerate(self.layout.blocks):
                x = _kept_in(x, pset.block_inputs[b])
                first = b * self.layout.block_size
                for position, layer in enumerate(block):
                    for k, sub in enumerate((layer.attention, layer.mlp)):
                        graph = (sublayer_fns or {}).get((layer.layer_number, k))
                        if graph is not None:
                            x, y, mappings = self._graphed(graph, layer.layer_number, sub,
                                                           position, k, x, seed_in, pset)
                        else:
                            x, y, mappings = self.sublayer(sub, position, k, x, seed_in, pset)
                        self._keep(pset, (first + position, k), y, mappings)
                if x.requires_grad:
                    handles.append(x.register_hook(self._make_block_hook(b, pset, state)))
        except BaseException:
            # Note [an unwound forward leaves nothing behind] (docs/design.md, item 6):
            # anything that unwinds the forward (MoECudaGraphPartialCaptureSignal included) leaves
            # no hook behind and gives the set back: nothing of this microbatch will run backward.
            for handle in handles:
                handle.remove()
            self.sets.release(pset)
            raise
        if handles:
            self._pending[pset.index] = state
            # its last block's state stays in the slots until something else writes them
            self._kept = (self.arena.generation, len(self.layout.blocks) - 1, pset.index)
        else:  # no gradient will flow (e.g. a frozen chunk): nothing will run backward
            self.sets.release(pset)
        return x

    def _graphed(self, graph: SublayerGraph, layer: int, sub, position: int, k: int, x: Tensor,
                 seed: Tensor | None, pset: PersistentSlotSet) -> tuple[Tensor, Tensor, Tensor]:
        """A sublayer through its graph (a :class:`SublayerGraph`, named as the graphed modes
        name it; a MoE head's graph then this runtime's eager tail), or a callable alone."""
        if not isinstance(graph, SublayerGraph):  # a callable alone names its own work
            return graph(x, seed, pset)
        if not graph.named:
            return graph.fn(x, seed)
        if graph.moe_step is None:
            with region("fwd", 0, None, f"{layer}.{SUBLAYER_NAMES[k]}"):
                return graph.fn(x, seed)
        with region("fwd", 0, None, f"{layer}.moe_head"):
            head = graph.fn(x, seed)
        with region("eager", 0, None, f"{layer}.moe_tail"):
            return self.moe_tail(sub, position, k, graph.moe_step, head, seed, pset)

    def moe_tail(self, sub: MHCSublayer, position: int, k: int, step: str,
                 head_outputs: Sequence[Tensor], seed: Tensor | None, pset: PersistentSlotSet
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """The eager rest of a MoE sublayer whose head was captured (megatron-core's partial
        capture: the router [and the dispatcher's preprocess]); returns (out, F output, state)."""
        state, x_on, hidden, probs, *rest = head_outputs
        moe: MoEMLP = sub.fn
        store = MoECudaGraphTensorStore()
        if step == "route":
            store.set(hidden_states=hidden, probs=probs, routing_map=rest[0])
        else:
            store.set(hidden_states=hidden, probs=probs)
            for name, value in zip(moe.token_dispatcher.valid_cudagraph_attrs, rest):
                setattr(moe.token_dispatcher, name, value)
        y = moe(x_on.narrow(-1, 0, hidden.shape[-1]), store)  # only its shape is read
        return self.sublayer_post(sub, position, k, y, (state, x_on), seed, pset)

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
        eagerly. Nothing is saved, so no slot, persistent set or graph is touched."""
        for layer in self.layout.layers:
            x = layer(x, seed)
        return x

    def _make_block_hook(self, block: int, pset: PersistentSlotSet, forward_state: dict):
        state = {"done": False}

        def hook(grad: Tensor) -> None:
            if forward_state["released"]:
                raise StaticRecomputeError(
                    f"backward of a forward that was released (release_pending(), or the next "
                    f"training step): persistent set {pset.index} and the arena may hold another "
                    f"microbatch now; run backward before the next step, or recompute the loss")
            if state["done"]:
                raise StaticRecomputeError(
                    f"second backward through recompute block {block}: its slots were already "
                    f"consumed and may be overwritten; run backward once per forward")
            state["done"] = True
            self.run_recompute(block, pset)
            if block == 0:
                self._pending.pop(pset.index, None)
                self.sets.release(pset)

        return hook

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
            state = self._pending.pop(pset.index, None)
            if state is not None:
                state["released"] = True
                self.sets.release(pset)
                released += 1
        return released

    # -- setup -----------------------------------------------------------------------------------
    def discover_layout(self, x: Tensor, seed: Tensor | None) -> None:
        """Run the first block once (layout discovery: slot sizes only, nothing written)."""
        if self.arena.allocated:
            return
        pset = self.sets.all_sets()[0]  # nothing is written: any set has the layout
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            for position, layer in enumerate(self.layout.blocks[0]):
                for k, sub in enumerate((layer.attention, layer.mlp)):
                    x = self.sublayer(sub, position, k, x, seed, pset)[0]

    def lay_out(self, seq_length: int, micro_batch_size: int, dtype: torch.dtype) -> None:
        """Name every arena slot (the strategy's, or what running the first block once on zeros
        saves), then allocate the arena; a no-op for an arena another chunk laid out."""
        self.sublayers.lay_out(seq_length, micro_batch_size, dtype)
        if self.sublayers.discovers_layout and not self.arena.allocated:
            cfg, device = self.layout.layers[0].attention.cfg, self.sets.all_sets()[0].seed.device
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
