"""What one training step of a megatron decoder holds and replays, measured while it runs.

:func:`measuring` wraps a step; its figures:

* **saved bytes per layer** (:func:`held_bytes`): the distinct storages the decoder holds from its
  forward to its backward, over its layers: what autograd keeps (parameters left out; a storage
  the recompute freed counts zero), what each replayed layer graph's backward reads that its
  forward left in the graphs' pool or static inputs, and the static runtime's persistent set. The
  runtime's arena is apart (:func:`arena_bytes`): see :func:`held_bytes`;
* **graph replays per step**: forward and backward replays of the layer graphs, and replays of
  mhc_cg's recompute graphs (and the block recomputes it skipped: a chunk's last block whose
  backward directly follows its forward finds its state still in the arena);
* **eager sublayer calls per step**: per sublayer (attention, MLP), how often its F, norm or mHC
  mappings ran as Python in the step, outside any graph replay (``0`` for a sublayer inside the
  layer graphs whose recompute replays as a graph too); in a MoE layer also its router
  (``moe_router``) and its dispatcher's preprocess (``moe_preprocess``), which partial capture
  puts in the layer graph;
* **mHC checkpoints per step**: the ``CheckpointWithoutOutput`` objects megatron's mHC recompute
  managers register (counted by wrapping ``CheckpointWithoutOutputManager.add_checkpoint`` for
  the step), and the sublayers mhc_cg's runtime recomputes (and those it kept from the forward);
* **fused ops per step**: mhc_cg's fused mHC ops (``mhc_cg::*``) the step ran, eagerly or in a
  graph replay (counted at dispatch: a tape replay dispatches what it recorded; a CUDA graph's
  replay dispatches nothing, so on a GPU the figure is the eager ones only), and the Triton
  kernel launches they stand for (:data:`mhc_cg.lab.cost.fused.LAUNCHES`).

Layer graphs expose what their backward reads only on the ``tape`` backend (the CPU emulation),
whether mhc_cg's ``make_graphed_callables`` or TE's own captured them; elsewhere the saved bytes
are ``None``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from types import SimpleNamespace
from typing import Callable, Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from mhc_cg.core.storage import storage_bytes, storage_id
from mhc_cg.graphs.graphed_callables import GraphedState
from mhc_cg.lab.cost.fused import LAUNCHES


def _count_checkpoints() -> tuple[Callable[[], int], Callable[[], None]]:
    """Count ``CheckpointWithoutOutputManager.add_checkpoint`` calls (megatron's mHC recompute
    managers); returns ``(count, undo)``. A megatron without the manager counts 0."""
    from megatron.core.tensor_parallel import random as mrandom

    # main's name, and dev's
    manager = (getattr(mrandom, "CheckpointWithoutOutputManager", None)
               or getattr(mrandom, "MHCCheckpointManager", None))
    if manager is None:
        return (lambda: 0), (lambda: None)
    calls = [0]
    original = manager.add_checkpoint

    def counted(self, ckpt):
        calls[0] += 1
        return original(self, ckpt)

    manager.add_checkpoint = counted

    def undo() -> None:
        manager.add_checkpoint = original

    return (lambda: calls[0]), undo


class StepProbe:
    """Measures the decoder's next forward (its first microbatch): :func:`held_bytes` of what
    autograd saved in it, taken when the forward ends."""

    def __init__(self, decoder: torch.nn.Module):
        self.decoder = decoder
        self.saved: list[Tensor] = []
        self.held_bytes: int | None = None
        self._context = contextlib.ExitStack()
        self._handles = [decoder.register_forward_pre_hook(self._enter),
                         decoder.register_forward_hook(self._leave)]

    def _enter(self, module, args) -> None:
        self._context.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))

    def _pack(self, t: Tensor) -> Tensor:
        self.saved.append(t)
        return t

    def _leave(self, module, args, output) -> None:
        self._context.close()
        self.close()
        self.held_bytes = held_bytes(self.decoder, self.saved)
        self.saved = []  # hold nothing past the measurement

    def close(self) -> int | None:
        """Stop measuring (a step whose forward did not run leaves ``held_bytes`` ``None``);
        returns ``held_bytes``."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return self.held_bytes


def _unpack(t: Tensor) -> Tensor:
    return t


def held_bytes(decoder: torch.nn.Module, saved: list[Tensor]) -> int | None:
    """Bytes of the distinct storages ``decoder`` holds for its backward; see the module docstring.

    The static runtime's arena is not among them: every block's recompute rewrites its slots
    before the block's backward, so it holds nothing from a forward to its backward; it is the
    recompute's workspace, once per rank (:func:`arena_bytes`), as the block of outputs that
    megatron's eager recompute re-allocates in the backward is its.
    """
    excluded = {storage_id(p) for p in decoder.parameters()}
    storages = storage_bytes(saved)
    for layer in decoder.layers:
        states = graph_states(layer)
        if states:
            read = backward_reads(states[getattr(layer, "current_microbatch", 0) % len(states)])
            if read is None:
                return None
            storages.update(read)
    static = _static(decoder)
    if static is not None:
        storages.update(storage_bytes(static.runtime.sets.template.tensors()))
        excluded.add(storage_id(static.runtime.arena.buffer))
    return sum(nbytes for key, nbytes in storages.items() if key not in excluded)


def arena_bytes(decoder: torch.nn.Module) -> int:
    """The static runtime's arena (one recompute block's mHC state, once per rank); 0 without."""
    static = _static(decoder)
    return static.runtime.arena.nbytes if static is not None else 0


def _static(decoder):
    """The decoder's static runtime block; ``None`` for a decoder on megatron's own forward."""
    return getattr(decoder, "mhc_static", None)


def graph_states(layer) -> list[GraphedState | SimpleNamespace | None]:
    """Each of the layer's TE graphs' state (megatron keeps the graphs in ``cuda_graphs``): mhc_cg's
    :class:`GraphedState`, or for TE's own function (:func:`te_graph_state`) the same three
    things read from what it returned; ``None`` where neither is found."""
    return [getattr(graphed, "state", None) or te_graph_state(graphed)
            for graphed in getattr(layer, "cuda_graphs", None) or ()]


def te_graph_state(graphed: Callable) -> SimpleNamespace | None:
    """A callable TE's ``make_graphed_callables`` returned, as ``fwd_graph``, ``bwd_graph`` (the
    graphs mhc_cg's ``torch.cuda`` API captured for it: off a GPU), ``static_grad_outputs`` and
    ``static_inputs`` (its static input surface: the inputs, then the parameters).
    TE keeps them in the closure of the autograd function it makes per callable; read there, a
    few levels down, by name (nothing is changed)."""
    found: dict[str, object] = {}
    seen: set[int] = set()

    def visit(value, depth: int) -> None:
        if id(value) in seen or depth > 6:
            return
        seen.add(id(value))
        if isinstance(value, type):
            for member in vars(value).values():
                visit(getattr(member, "__func__", member), depth + 1)
            return
        value = getattr(value, "__wrapped__", value)
        code, cells = getattr(value, "__code__", None), getattr(value, "__closure__", None)
        if code is None or cells is None:
            return
        for name, cell in zip(code.co_freevars, cells):
            try:
                content = cell.cell_contents
            except ValueError:  # not yet bound
                continue
            if name in ("fwd_graph", "bwd_graph", "static_grad_outputs", "static_input_surface"):
                found.setdefault(name, content)
            visit(content, depth + 1)

    visit(getattr(graphed, "forward", graphed), 0)
    graphs = [getattr(found.get(name), "graph", None) for name in ("fwd_graph", "bwd_graph")]
    if graphs[0] is None:
        return None
    return SimpleNamespace(fwd_graph=graphs[0], bwd_graph=graphs[1],
                           static_grad_outputs=list(found.get("static_grad_outputs") or ()),
                           static_inputs=list(found.get("static_input_surface") or ()))


def backward_reads(state: GraphedState | SimpleNamespace | None) -> dict[int, int] | None:
    """``{storage: bytes}`` a graphed callable's backward graph reads that its capture did not
    allocate and that are not its grad-output buffers (what the forward left for it); ``None``
    where the backend keeps no record of what its kernels read."""
    read = None if state is None or state.bwd_graph is None else state.bwd_graph.external_reads()
    if read is None:
        return None
    grad_outputs = {storage_id(g) for g in state.static_grad_outputs if g is not None}
    return {key: nbytes for key, nbytes in read.items() if key not in grad_outputs}


def graph_replays(decoder: torch.nn.Module) -> tuple[int, int]:
    """``(layer graph replays, recompute graph replays)`` so far (forward and backward graphs)."""
    layer = sum(g.replays for module in decoder.layers for state in graph_states(module)
                if state is not None for g in (state.fwd_graph, state.bwd_graph) if g is not None)
    static = _static(decoder)
    recompute = sum(g.replays for g in static.runtime.recompute_graphs.values()) if static else 0
    return layer, recompute


def recompute_runs(decoder: torch.nn.Module, since: Counter) -> Counter:
    """What the static runtime did for its block recomputes since its counts were ``since``:
    ``{(how, "blocks" | "sublayers"): count}``, ``how`` being ``"ran"`` (a graph or eager) or
    ``"kept"`` (the arena still held the block's forward)."""
    static = _static(decoder)
    runs: Counter = Counter()
    if static is None:
        return runs
    runtime = static.runtime
    for (block, how), n in (runtime.recomputes - since).items():
        how = "kept" if how == "kept" else "ran"
        runs[(how, "blocks")] += n
        runs[(how, "sublayers")] += len(runtime.layout.blocks[block]) * n
    return runs


def _recompute_counts(decoder) -> Counter:
    static = _static(decoder)
    return Counter(static.runtime.recomputes) if static is not None else Counter()


@contextlib.contextmanager
def measuring(decoders: list[torch.nn.Module], into: dict) -> Iterator[None]:
    """Measure the step run inside over a rank's model chunks' ``decoders`` (see the module
    docstring); the figures go into ``into``."""
    probes = [StepProbe(decoder) for decoder in decoders]
    before = [graph_replays(decoder) for decoder in decoders]
    runs = [_recompute_counts(decoder) for decoder in decoders]
    per_graph = [layer_graph_replays(decoder) for decoder in decoders]
    checkpoints, undo = _count_checkpoints()
    eager_calls, undo_calls = _count_eager_sublayer_calls(decoders)
    fused = FusedOpCounter()
    try:
        with fused:
            yield
    finally:
        undo()
        undo_calls()
    after = [graph_replays(decoder) for decoder in decoders]
    held = [probe.held_bytes for probe in probes]
    layers = sum(len(decoder.layers) for decoder in decoders)
    static = _static(decoders[0])
    done = sum((recompute_runs(decoder, since) for decoder, since in zip(decoders, runs)),
               Counter())
    into.update(
        saved_bytes_per_layer=None if None in held else round(sum(held) / layers),
        layer_graph_replays_per_step=sum(a[0] - b[0] for a, b in zip(after, before)),
        recompute_graph_replays_per_step=sum(a[1] - b[1] for a, b in zip(after, before)),
        layer_graphs_not_replayed_in_step=sum(
            a == b for decoder, counts in zip(decoders, per_graph)
            for a, b in zip(layer_graph_replays(decoder), counts)),
        eager_sublayer_calls_per_step=dict(eager_calls),
        mhc_checkpoints_per_step=checkpoints(),
        recomputed_sublayers_per_step=done[("ran", "sublayers")],
        kept_sublayers_per_step=done[("kept", "sublayers")],
        recompute_blocks_kept_per_step=done[("kept", "blocks")],
        fused_op_calls_per_step=sum(fused.calls.values()),
        fused_kernel_launches_per_step=sum(LAUNCHES.get(op, 1) * n
                                           for op, n in fused.calls.items()),
        arena_bytes=arena_bytes(decoders[0]),  # one arena per rank, shared by its chunks
        persistent_slot_sets=static.runtime.sets.capacity if static is not None else 0)


class FusedOpCounter(TorchDispatchMode):
    """Counts the ``mhc_cg::*`` ops dispatched while it is on (``calls``: ``{op: count}``)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mhc_cg":
            self.calls[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


# per sublayer: its F and norm (modules), its hyper-connection (attribute names of main's and dev's
# layers, then mhc_cg's) and the mapping methods every one of them runs first
_SUBLAYER_PARTS = {"attention": (("self_attention", "input_layernorm"),
                                 ("self_attention_hyper_connection", "attention_hc")),
                   "mlp": (("mlp", "pre_mlp_layernorm"), ("mlp_hyper_connection", "mlp_hc"))}
_MAPPING_METHODS = ("compute_mappings", "pre")


def _count_eager_sublayer_calls(decoders) -> tuple[Counter, Callable[[], None]]:
    """Count, per sublayer, calls of its modules' forwards and its hyper-connection's mapping
    method while the step runs as Python (a graph replay calls none); returns ``(counts, undo)``."""
    counts: Counter = Counter()
    undo: list[Callable[[], None]] = []
    for decoder in decoders:
        for layer in decoder.layers:
            for which, (modules, hcs) in _SUBLAYER_PARTS.items():
                for name in modules:
                    module = getattr(layer, name, None)
                    if isinstance(module, torch.nn.Module):
                        handle = module.register_forward_pre_hook(
                            lambda *_, which=which: counts.update([which]))
                        undo.append(handle.remove)
                hc = next((getattr(layer, n) for n in hcs if hasattr(layer, n)), None)
                method = next((m for m in _MAPPING_METHODS if hasattr(hc, m)), None)
                if method is not None:
                    undo.append(_count_method(hc, method, counts, which))
            if getattr(layer, "is_moe_layer", False):  # the MoE steps partial capture may hold
                handle = layer.mlp.router.register_forward_pre_hook(
                    lambda *_: counts.update(["moe_router"]))
                undo.append(handle.remove)
                undo.append(_count_method(layer.mlp.token_dispatcher, "dispatch_preprocess",
                                          counts, "moe_preprocess"))
    return counts, lambda: [u() for u in undo]


def _count_method(obj, name: str, counts: Counter, key: str) -> Callable[[], None]:
    original = getattr(obj, name)

    def counted(*args, **kwargs):
        counts.update([key])
        return original(*args, **kwargs)

    setattr(obj, name, counted)
    return lambda: delattr(obj, name)


def layer_graph_replays(decoder: torch.nn.Module) -> list[int]:
    """Replays so far of each of ``decoder``'s layer graphs (forward and backward graphs)."""
    return [g.replays for module in decoder.layers for state in graph_states(module)
            if state is not None for g in (state.fwd_graph, state.bwd_graph) if g is not None]
