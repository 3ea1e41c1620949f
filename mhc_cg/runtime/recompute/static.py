"""Static-buffer mHC recompute: forward, discard and recompute on fixed addresses.

How it works, per sublayer of a recompute block (docs/design.md, invariants 1-4):

* The ordinary mHC ops run under ``saved_tensors_hooks``. Whatever autograd saves inside the mHC
  part is copied into the next slot of the sublayer's arena region and autograd keeps a *view of
  the slot* instead of the tensor, so the forward frees its temporaries at once. The autograd graph
  is the one eager builds: same ops, same order, so gradients are bit-identical to no recompute.
* F (attention, MLP) is not recomputed. Its own saved tensors are kept as usual; its input, the
  normed aggregate, is stored in a slot first (``store``) so F saves a slot view too.
* Per microbatch, a persistent slot set keeps only x_l0 of each block, each F output and the dropout
  seed. The block recompute is then a pure function of those: it re-runs the block's mHC ops (not
  F) with the same hooks, writing the same values into the same slots. It has static inputs and
  outputs, so a graph backend can capture it once per (block, persistent set) and replay it.
* A hook on the gradient of the block output runs (or replays) the recompute; the block's first
  backward node runs only after that gradient exists.
* Activation recompute for an MLP that asks for it: fc1's output goes to the persistent
  set (``fc1_outputs``; the gelu saves a view of it), the gelu output to one arena slot per layer
  position (region ``L{pos}.mlp.act``; fc2 saves a view of it), and the block recompute re-derives
  the gelu output from the persistent fc1 output into that slot. A microbatch then keeps fc1's
  output only, not the activation too; the arena grows by one activation per block position.

Invariants the tests check: slot addresses never move, nothing is resized or re-pointed after
``prepare``, and the arena does not grow with the number of microbatches.
"""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from typing import Callable, Iterator

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

import torch.nn.functional as F

from mhc_cg.core import traffic
from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.model import MLP, MHCSublayer, MHCTransformerLayer, recomputes_activation
from mhc_cg.runtime.graphs.static_inputs import check_input, is_buffer
from mhc_cg.ops.kernels import Target, recompute_block
from mhc_cg.ops.output_linear import output_into
from mhc_cg.runtime.recompute.arena import Arena, Region
from mhc_cg.runtime.recompute.fused_slots import FusedSlots
from mhc_cg.runtime.recompute.persistent import PersistentSetPool, PersistentSlotSet, new_persistent_set
from mhc_cg.core.nvtx import nvtx_range
from mhc_cg.core.storage import storage_id

SUBLAYER_NAMES = ("attn", "mlp")


class _RegionCursor:
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


class _StoreToSlot(torch.autograd.Function):
    """Identity whose output lives in an arena slot (so consumers save a slot view)."""

    @staticmethod
    def forward(ctx, t: Tensor, cursor: _RegionCursor) -> Tensor:
        out = cursor.save(t.contiguous())
        return out if out is not t else t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _StoreToPersistent(torch.autograd.Function):
    """Identity whose output is a view of ``pset.fc1_outputs[index]`` (consumers save that view).

    The set is passed as a non-tensor argument so the output is not an autograd view of an input.
    """

    @staticmethod
    def forward(ctx, t: Tensor, pset: PersistentSlotSet, index: int) -> Tensor:
        dst = pset.fc1_outputs[index]
        with traffic.runtime_copy("persistent set"):
            dst.copy_(t)  # nothing saved a view of dst since the set was acquired: no version clash
        return dst.as_strided(dst.size(), dst.stride(), dst.storage_offset())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None


class _StoreToPersistentSlot(torch.autograd.Function):
    """Identity whose output is the persistent slot ``dst`` (written here): a block input, an F
    output."""

    @staticmethod
    def forward(ctx, t: Tensor, dst: Tensor) -> Tensor:
        with traffic.runtime_copy("persistent set"):
            dst.copy_(t)  # nothing saved a view of dst since the set was acquired: no version clash
        return dst.as_strided(dst.size(), dst.stride(), dst.storage_offset())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class StaticRecompute:
    """The static-buffer runtime for the layers of one model chunk.

    ``layers`` are split into recompute blocks of ``block_size`` layers. ``arena`` and the persistent
    set pool may be shared by several chunks of one pipeline rank (they have the same block shape).
    """

    def __init__(self, layers: list[MHCTransformerLayer], block_size: int, arena: Arena,
                 sets: PersistentSetPool, slots: FusedSlots | None = None):
        if block_size < 1:
            raise StaticRecomputeError(f"block_size must be >= 1, got {block_size}")
        cfg = layers[0].attention.cfg
        if cfg.dropout_impl == "torch" and cfg.hidden_dropout > 0:
            raise StaticRecomputeError(
                "static-buffer recompute needs dropout_impl='counter': a recompute (and a replayed "
                "graph) cannot rewind torch's stateful generator to redraw the forward's mask")
        self.layers = list(layers)
        self.block_size = block_size
        self.blocks = [self.layers[i:i + block_size] for i in range(0, len(self.layers), block_size)]
        self.arena, self.sets = arena, sets
        # fused sublayers name every buffer (FusedSlots); stepwise ones save through the hooks
        self.fused = layers[0].attention.fused
        if self.fused and slots is None:
            raise StaticRecomputeError("fused sublayers need their FusedSlots: build the runtime "
                                       "with build_static_recompute")
        self.slots = slots
        self._cursor: _RegionCursor | None = None
        self._in_fn = False
        self.active_set: PersistentSlotSet | None = None  # the set of the forward in progress
        self._mlp_index = {id(layer.mlp): i for i, layer in enumerate(self.layers)}
        self._sub_index = {id(sub): i for i, layer in enumerate(self.layers)
                           for sub in (layer.attention, layer.mlp)}
        # With one set, F outputs go to it before h_post saves them: saved as they are, never
        # copied into slots. With several, a graph captured outside ``forward`` could not know
        # its microbatch's set, so F outputs are copied into slots like any saved tensor.
        self._fn_output_storages = ({storage_id(t) for t in sets.all_sets()[0].fn_outputs.values()}
                                    if sets.capacity == 1 else set())
        self.recompute_graphs: dict[tuple[int, int], object] = {}
        self.recompute_pool = None  # the pool the recompute graphs were captured into
        # Parameters (and views of them, e.g. a transposed weight) are saved as they are: they do
        # not change between a forward and its backward, so copying them into slots is waste.
        self._param_storages = {storage_id(p) for layer in self.layers for p in layer.parameters()}
        # Block inputs likewise, with one set: the block's first mHC ops save it from there
        self._block_input_storages = ({storage_id(t) for t in sets.all_sets()[0].block_inputs}
                                      if sets.capacity == 1 else set())
        # The last recomputes run, in order (for tests and debugging): a ring of two rounds of
        # every (block, set), so a long run keeps a fixed number; ``recomputes`` counts them all.
        self.trace: deque[str] = deque(maxlen=2 * len(self.blocks) * sets.capacity)
        self.recomputes: Counter[tuple[int, str]] = Counter()  # (block, "graph" | "eager") -> runs
        # forwards whose backward has not finished: persistent set index -> its hooks' state
        self._pending: dict[int, dict] = {}

    # -- hooks ------------------------------------------------------------------------------
    def _pack(self, t: Tensor) -> Tensor:
        key = storage_id(t)
        if (self._in_fn or self.arena.contains(t) or key in self._param_storages
                or key in self._fn_output_storages or key in self._block_input_storages):
            return t
        return self._cursor.save(t)

    @contextlib.contextmanager
    def mhc_region(self, position: int, sublayer: int, segment: int = 0) -> Iterator[None]:
        """Everything autograd saves in here goes to arena region (position, sublayer, segment)."""
        name = f"L{position}.{SUBLAYER_NAMES[sublayer]}.{segment}"
        previous = self._cursor
        self._cursor = _RegionCursor(self.arena, self.arena.region(name))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self._cursor = previous

    @contextlib.contextmanager
    def fn_region(self) -> Iterator[None]:
        """F's own activations are kept by autograd as usual (F is not recomputed)."""
        self._in_fn = True
        try:
            yield
        finally:
            self._in_fn = False

    def store(self, t: Tensor) -> Tensor:
        return _StoreToSlot.apply(t, self._cursor)

    # -- one sublayer ------------------------------------------------------------------------
    def sublayer_pre(self, sub: MHCSublayer, position: int, k: int,
                     x: Tensor) -> tuple[Tensor, tuple]:
        """The mHC ops before F: returns (F's input, what :meth:`sublayer_post` takes).

        Fused sublayers write F's input into its arena slot and the mapping state into the
        persistent set (:mod:`mhc_cg.runtime.recompute.fused_slots`). Stepwise ones save into
        region segment 0 through the hooks, and the carry is ``(h_post, mixed)``:

        ``h_res`` is applied here, before F, so that a graph which ends inside F (MoE partial
        capture) holds every consumer of ``x``; the gradient of ``x`` is then summed in the same
        order as in ``MHCSublayer.forward`` (consumers run backward in reverse creation order, and
        h_res stays the last consumer of ``x`` created).
        """
        if self.fused:
            j, pset = 2 * position + k, self._direct_set()
            state_out = None if pset is None else Target.of(pset.states[self._key(sub, k)])
            fn_input, state, x_on = sub.pre(x, self.slots.fn_input(j), state_out)
            return fn_input, (state, x_on)
        if (position == 0 and k == 0 and self._block_input_storages
                and storage_id(x) not in self._block_input_storages):
            x = self._block_input_to_set(sub, x)  # the forward; the recompute reads it from there
        with self.mhc_region(position, k, 0):
            h_pre, h_post, h_res = sub.mappings(x)
            normed = self.store(sub.norm(sub.aggregate(x, h_pre)))
            mixed = sub.h_res_step(h_res, x)
        return normed, (h_post, mixed)

    def sublayer_post(self, sub: MHCSublayer, position: int, k: int, y: Tensor, carry: tuple,
                      seed: Tensor | None) -> Tensor:
        """The mHC ops after F, ``carry`` what :meth:`sublayer_pre` returned.

        Fused sublayers keep ``y`` in the persistent set and write the output into the next
        sublayer's input buffer. Stepwise ones save into region segment 1:
        ``mixed + dropout(h_post * y)``.

        With one persistent set, ``y`` (F's output) goes to its persistent slot first, so that
        ``h_post``'s product saves the persistent tensor itself: the forward and the recompute
        (which reads ``y`` from there) then save the same tensor, and the arena holds no second
        copy of it.
        """
        if self.fused:
            state, x_on = carry
            pset = self._direct_set()
            if pset is not None and not is_buffer(pset.fn_outputs[self._key(sub, k)], y):
                y = _StoreToPersistentSlot.apply(y, pset.fn_outputs[self._key(sub, k)])
            return sub.post(x_on, state, y, seed, self._output_target(sub, position, k, pset))
        h_post, mixed = carry
        y = self._fn_output_to_set(sub, k, y)
        with self.mhc_region(position, k, 1):
            return sub.post_bda(y, h_post, mixed, seed)

    def sublayer(self, sub: MHCSublayer, position: int, k: int, x: Tensor,
                 seed: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """``MHCSublayer.forward`` on the static buffers; returns (output, F output, mapping
        state or None for stepwise sublayers).

        Two halves, because a graph may end between them (MoE partial capture) and the eager
        remainder must find its buffers without the Python state of the captured part.
        """
        fn_input, carry = self.sublayer_pre(sub, position, k, x)
        pset = self._direct_set() if self.fused else None
        # F's last Linear writes its output into the set itself (no copy after F)
        with output_into(None if pset is None else pset.fn_outputs[self._key(sub, k)]):
            if k == 1 and recomputes_activation(sub):
                y = self.mlp_with_activation_recompute(sub.fn, position, self._mlp_index[id(sub)],
                                                       fn_input, self._set_for_fn())
            else:
                with self.fn_region():
                    y = sub.fn(fn_input)
        out = self.sublayer_post(sub, position, k, y, carry, seed)
        return out, self.kept_fn_output(sub, k, y), carry[0] if self.fused else None

    def kept_fn_output(self, sub, k: int, y: Tensor) -> Tensor:
        """F's output ``y`` as the persistent set keeps it, where a fused post put it there."""
        pset = self._direct_set() if self.fused else None
        return y if pset is None else pset.fn_outputs[self._key(sub, k)]

    # -- fused sublayers: the buffers ---------------------------------------------------------
    def _key(self, sub, k: int) -> tuple[int, int]:
        """``(layer in the chunk, sublayer)``: the persistent set's key."""
        return self._sub_index[id(sub)], k

    def _direct_set(self) -> PersistentSlotSet | None:
        """The set a fused sublayer writes its state and F output into: the forward's, or the only
        one; ``None`` for a capture with several sets (it cannot know its microbatch's set: the
        forward copies them in after the sublayer, :meth:`_keep`)."""
        if self.active_set is not None:
            return self.active_set
        return self.sets.all_sets()[0] if self.sets.capacity == 1 else None

    def _output_target(self, sub, position: int, k: int, pset) -> Target | None:
        """The next sublayer's input slot; for a block's last, the next block's input (in the
        set); ``None`` for the chunk's output."""
        i = self._sub_index[id(sub)]
        block, j = i // self.block_size, 2 * position + k
        if j + 1 < 2 * len(self.blocks[block]):
            return self.slots.stream(j + 1)
        if block + 1 < len(self.blocks) and pset is not None:
            return Target.of(pset.block_inputs[block + 1])
        return None

    def _block_input(self, b: int, x: Tensor, pset: PersistentSlotSet) -> Tensor:
        """Block ``b``'s input as the set's tensor (written there unless it already is)."""
        dst = pset.block_inputs[b]
        if storage_id(dst) == storage_id(x) and dst.storage_offset() == x.storage_offset():
            return x
        return _StoreToPersistentSlot.apply(x, dst)

    def _keep(self, pset: PersistentSlotSet, key: tuple[int, int], y: Tensor,
              state: Tensor | None) -> None:
        """What the recompute reads: F's output (and a fused sublayer's state) into the set,
        unless the sublayer wrote it there."""
        for dst, t in ((pset.fn_outputs[key], y), (pset.states.get(key), state)):
            if dst is None or t is None:
                continue
            if storage_id(dst) != storage_id(t) or dst.storage_offset() != t.storage_offset():
                with traffic.runtime_copy("persistent set"):
                    dst.copy_(t.detach())

    def _fn_output_to_set(self, sub: MHCSublayer, k: int, y: Tensor) -> Tensor:
        if not self._fn_output_storages or storage_id(y) in self._fn_output_storages:
            return y  # several sets (see __init__), or the recompute reading it from its set
        return _StoreToPersistentSlot.apply(
            y, self._set_for_fn().fn_outputs[(self._sub_index[id(sub)], k)])

    def _block_input_to_set(self, sub: MHCSublayer, x: Tensor) -> Tensor:
        """x_l0 goes to its persistent slot first, so the block's first mHC ops save the persistent
        tensor itself: the arena holds no second copy of it, and the recompute (which reads it
        from there) copies nothing."""
        block = self._sub_index[id(sub)] // self.block_size
        return _StoreToPersistentSlot.apply(x, self._set_for_fn().block_inputs[block])

    # -- activation recompute ---------------------------------------------------------------
    def _activation_cursor(self, position: int) -> _RegionCursor:
        return _RegionCursor(self.arena, self.arena.region(f"L{position}.mlp.act"))

    def _set_for_fn(self) -> PersistentSlotSet:
        """The persistent set an MLP with activation recompute writes fc1's output into.

        Outside ``forward`` (layout discovery, a graphed ``mlp`` sublayer's warmup and capture)
        that is the only set; a captured MLP graph writes the set it was captured with, so with
        more sets it would overwrite another microbatch's fc1 output.
        """
        if self.active_set is not None:
            return self.active_set
        if self.sets.capacity == 1:
            return self.sets.all_sets()[0]
        raise StaticRecomputeError(
            f"an MLP with activation recompute ran outside StaticRecompute.forward with "
            f"{self.sets.capacity} persistent sets: a graphed 'mlp' sublayer would write fc1's "
            f"output into the one set it was captured with; capture 'mlp' with one set "
            f"(capacity 1), or leave 'mlp' out of the scopes")

    def mlp_with_activation_recompute(self, mlp: MLP, position: int, index: int, normed: Tensor,
                                      pset: PersistentSlotSet) -> Tensor:
        """``mlp(normed)`` (fc1 -> gelu -> fc2) with fc1's output in ``pset.fc1_outputs[index]``
        and the gelu output in the arena slot of ``position``: a microbatch keeps neither the
        activation nor a second copy of fc1's output; ``recompute_block`` refills the slot."""
        if index not in pset.fc1_outputs:
            raise StaticRecomputeError(
                f"persistent set {pset.index} has no fc1 output slot for chunk layer {index} "
                f"(it has {sorted(pset.fc1_outputs)}); build the sets from a chunk whose layers "
                f"recompute their activation at least where this chunk's do")
        with self.fn_region():
            pre = _StoreToPersistent.apply(mlp.fc1(normed), pset, index)
            act = F.gelu(pre)  # saves ``pre``: a view of the persistent slot
        act = _StoreToSlot.apply(act, self._activation_cursor(position))
        with self.fn_region():
            return mlp.fc2(act)  # saves ``act``: a view of the arena slot

    def recompute_activation_slot(self, position: int, pre: Tensor) -> None:
        """Write ``gelu(pre)`` into the activation slot of ``position`` (part of the block recompute)."""
        with torch.no_grad():
            self._activation_cursor(position).save(F.gelu(pre))

    # -- the block recompute ---------------------------------------------------------------------
    def recompute_block(self, block: int, pset: PersistentSlotSet) -> None:
        """Re-run block ``block``'s mHC ops from ``pset`` into the arena (no F, nothing returned).

        Grad mode is on so that autograd saves, and the hooks store, exactly what the forward
        stored; the autograd graph built here is dropped on return.
        """
        if self.fused:
            return self._recompute_fused(block, pset)
        with torch.enable_grad():
            x = pset.block_inputs[block].detach().requires_grad_()
            first = block * self.block_size
            for position, layer in enumerate(self.blocks[block]):
                for k, sub in enumerate((layer.attention, layer.mlp)):
                    y = pset.fn_outputs[(first + position, k)].detach().requires_grad_()
                    # Drop each temporary at its last use: what reads it saved it into slots,
                    # and the graph's pool then holds at most two of the n-stream tensors at once.
                    pre = self.sublayer_pre(sub, position, k, x)
                    x = None
                    x = self.sublayer_post(sub, position, k, y, pre[1], pset.seed)
                    pre = None
                if recomputes_activation(layer.mlp):
                    self.recompute_activation_slot(position, pset.fc1_outputs[first + position])

    def _recompute_fused(self, block: int, pset: PersistentSlotSet) -> None:
        """The block's chain in one op, from the set into the arena slots; then the activations."""
        layers = self.blocks[block]
        subs = [sub for layer in layers for sub in (layer.attention, layer.mlp)]
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
                            hc.kernels)
        first = block * self.block_size
        for position, layer in enumerate(layers):
            if recomputes_activation(layer.mlp):
                self.recompute_activation_slot(position, pset.fc1_outputs[first + position])

    def warm_up_recompute(self, backend) -> None:
        """Run every block's recompute once eagerly, in the backend's warmup context (a side stream
        on CUDA), so that lazy library setup (cuBLAS handles, workspaces) never happens inside a
        capture. It writes slots that the next forward overwrites anyway."""
        with backend.warmup():
            for block in range(len(self.blocks)):
                self.recompute_block(block, self.sets.all_sets()[0])
        backend.synchronize()

    def capture_recompute_graph(self, backend, pool, block: int, pset: PersistentSlotSet) -> None:
        """Capture block ``block``'s recompute from ``pset`` into ``pool``.

        It must leave nothing of the pool allocated (it writes only arena slots, which are not the
        pool's): its temporaries are dead when the block's backward starts, whatever shares the pool.
        """
        graph = backend.new_graph(pool=pool)
        with graph.capture(), traffic.phase("recompute"):
            self.recompute_block(block, pset)
        if graph.stats.escaped_bytes:
            raise StaticRecomputeError(
                f"recompute graph of block {block}: {graph.stats.escaped_bytes} bytes allocated by "
                f"the capture are still alive after it; a later graph of the pool could overwrite them")
        self.recompute_graphs[(block, pset.index)] = graph
        self.recompute_pool = pool

    def capture_recompute_graphs(self, backend) -> None:
        """One recompute graph per (block, persistent set), all in one pool of their own.

        The recompute graphs of a rank run one at a time, and each leaves nothing allocated when
        it ends: the pool is *independent* (the backend checks at capture that no temporary
        outlives it), sized by one recompute's live set rather than one pool per graph, and the
        graphs may replay in any order. They are captured in the order a backward replays them
        (last block first, sets in turn). When the sublayer graphs replay in a fixed order, the
        graphed model captures the recompute graphs into their pool instead, each at the point
        where it replays (``GraphedStaticModel``), and this is not called.
        """
        self.warm_up_recompute(backend)
        pool = self.recompute_pool or backend.new_pool(independent=True)
        for pset in self.sets.all_sets():
            for block in reversed(range(len(self.blocks))):
                if (block, pset.index) not in self.recompute_graphs:
                    self.capture_recompute_graph(backend, pool, block, pset)

    def run_recompute(self, block: int, pset: PersistentSlotSet) -> None:
        graph = self.recompute_graphs.get((block, pset.index))
        how = "graph" if graph is not None else "eager"
        self.recomputes[(block, how)] += 1
        self.trace.append(f"recompute block {block} set {pset.index} ({how})")
        # same range name as eager block recompute
        with nvtx_range("recompute", 0, None, f"block{block}"), traffic.phase("recompute"):
            if graph is not None:
                graph.replay()
            else:
                self.recompute_block(block, pset)

    # -- the chunk forward -----------------------------------------------------------------------
    def forward(self, x: Tensor, seed: Tensor | None,
                sublayer_fns: dict[tuple[int, int], Callable] | None = None) -> Tensor:
        """Run the chunk; returns its output. ``sublayer_fns[(layer, k)]`` replaces the eager
        sublayer (e.g. by a graphed callable) and must return ``(out, fn_output)``."""
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
        self.active_set = pset
        handles = []
        state = {"released": False}
        try:
            if seed is not None:
                with traffic.runtime_copy("persistent set"):
                    pset.seed.copy_(seed)
            seed_in = pset.seed if seed is not None else None
            for b, block in enumerate(self.blocks):
                if self.fused:
                    x = self._block_input(b, x, pset)
                elif not self._block_input_storages:  # else the block's first sublayer stores it
                    with traffic.runtime_copy("persistent set"):
                        pset.block_inputs[b].copy_(x.detach())
                first = b * self.block_size
                for position, layer in enumerate(block):
                    for k, sub in enumerate((layer.attention, layer.mlp)):
                        fn = (sublayer_fns or {}).get((layer.layer_number, k))
                        if fn is not None:
                            x, y, mappings = fn(x, seed_in)
                        else:
                            x, y, mappings = self.sublayer(sub, position, k, x, seed_in)
                        self._keep(pset, (first + position, k), y, mappings)
                if x.requires_grad:
                    handles.append(x.register_hook(self._make_block_hook(b, pset, state)))
        except BaseException:
            # Anything that unwinds the forward (MoECudaGraphPartialCaptureSignal included) leaves
            # no hook behind and gives the set back: nothing of this microbatch will run backward.
            for handle in handles:
                handle.remove()
            self.sets.release(pset)
            raise
        finally:
            self.active_set = None
        if handles:
            self._pending[pset.index] = state
        else:  # no gradient will flow (e.g. a frozen chunk): nothing will run backward
            self.sets.release(pset)
        return x

    def forward_only(self, x: Tensor, seed: Tensor | None) -> Tensor:
        """The chunk without a backward to come (evaluation, ``no_grad``): the plain layers,
        eagerly. Nothing is saved, so no slot, persistent set or graph is touched."""
        for layer in self.layers:
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
        self.active_set = self.sets.all_sets()[0]  # only fc1 outputs are written, into set 0
        try:
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                for position, layer in enumerate(self.blocks[0]):
                    for k, sub in enumerate((layer.attention, layer.mlp)):
                        x = self.sublayer(sub, position, k, x, seed)[0]
        finally:
            self.active_set = None


def _unpack(t: Tensor) -> Tensor:
    return t


def build_static_recompute(layers: list[MHCTransformerLayer], block_size: int, *,
                           seq_length: int, micro_batch_size: int, capacity: int,
                           device: torch.device | str, arena: Arena | None = None,
                           sets: PersistentSetPool | None = None,
                           dtype: torch.dtype = torch.float32) -> StaticRecompute:
    """Lay out and allocate everything static for one chunk: arena (shared if given) and sets.

    The layout is discovered by running the first block once on zeros with the real shapes; the
    arena is then allocated in one piece. Pass the same ``arena`` (and, for chunks of equal depth,
    the same ``sets``) to every chunk of a rank: both are then sized by the rank, not by the
    number of chunks or microbatches.
    """
    arena = arena if arena is not None else Arena(device)
    if sets is None:
        sets = PersistentSetPool(capacity, lambda i: new_persistent_set(
            i, layers, block_size, seq_length, micro_batch_size, device, dtype))
    cfg = layers[0].attention.cfg
    slots = None
    if layers[0].attention.fused:
        slots = FusedSlots(arena, block_size, cfg, seq_length, micro_batch_size, dtype)
        _claim_activation_slots(arena, layers, block_size, seq_length, micro_batch_size, dtype)
    runtime = StaticRecompute(layers, block_size, arena, sets, slots)
    if slots is not None:
        arena.allocate()
    elif not arena.allocated:
        x = torch.zeros(seq_length, micro_batch_size, cfg.num_streams * cfg.hidden_size,
                        dtype=dtype, device=device)
        runtime.discover_layout(x, torch.zeros((), dtype=torch.int64, device=device))
        arena.allocate()
    return runtime


def _claim_activation_slots(arena: Arena, layers, block_size: int, seq_length: int,
                            micro_batch_size: int, dtype: torch.dtype) -> None:
    """One gelu-output slot per block position whose MLP recomputes its activation."""
    item = torch.empty((), dtype=dtype).element_size()
    for i, layer in enumerate(layers):
        if recomputes_activation(layer.mlp):
            ffn = layer.mlp.fn.fc1.out_features
            arena.fixed_slot(f"L{i % block_size}.mlp.act",
                             seq_length * micro_batch_size * ffn * item, dtype)
