"""The tape: a CPU emulation of CUDA graph capture and replay.

Capture runs the body once under a ``TorchDispatchMode`` that records every aten op it sees,
forward and backward alike (``torch.autograd.grad`` inside a capture dispatches its ops through
the same mode). Replay re-runs the recorded ``OpOverload``s with the recorded arguments, where the
tensor arguments are the very tensors seen at capture, so it has a CUDA graph's semantics:

* **addresses are static**: every tensor the capture allocated stays alive in the tape (it belongs
  to the graph's pool) and a replay writes into it; an op that allocated a fresh output at capture
  is re-run and its result copied into the captured output;
* **no Python of the user's runs** at replay: side effects, hooks and Python control flow happen
  once, at capture, exactly as on a GPU;
* **what a graph cannot hold is rejected at capture** (:class:`~mhc_cg.graphs.guard.CaptureGuardMode`;
  ``Tensor.tolist``/``numpy``/``cpu`` dispatch no op on the CPU, so the tape traps them while
  capturing).

How each recorded op replays (decided once, at capture):

* *view* (the schema says the output aliases an input, or the output shares an input's storage):
  nothing to do, the captured view still aliases the same storage with the same metadata;
* *metadata mutation* (``transpose_``, ``set_``, ``resize_`` on an owned tensor): skipped, its
  effect on the tensor object persists. Ops recorded before it referred to the tensor's old
  metadata, so their references are swapped for a frozen alias (same storage, old metadata);
* *in-place / out=* (writes an argument): re-run as recorded, writing the same tensors (and, for
  an op that also returns new tensors, copying those into the captured outputs);
* *uninitialised allocation* (``empty``, ``empty_like``, ...): nothing to do;
* *functional* (fresh outputs): re-run and ``copy_`` the results into the captured outputs.

A capture runs nothing, as on a GPU: the body runs once to be recorded, and every storage it
wrote that it did not allocate is put back when the capture ends (Note [a capture runs nothing]).

The tape also re-checks, before each replay, that every storage it used still has the size and
address it had at capture: on a GPU a freed input or output reads or writes garbage silently.

What a launch freezes in a kernel's arguments, a replay keeps, where a replay of the recorded
Python-level ops would otherwise read the present:

* **CPU scalars.** CUDA passes a 0-dim CPU tensor among a device op's operands by value: it is read
  on the host when the kernel is launched, so a graph keeps the value it had at capture (on CUDA
  the guard refuses it). The tape's one device is the host, so ``device`` cannot tell a CPU scalar
  from a 0-dim device tensor; the tape takes for device memory what a GPU run keeps there: what a
  capture of the tape allocated (this graph or any live one), parameters, and static buffers
  (:func:`~mhc_cg.graphs.static_inputs.static_buffer`: graphed callables' inputs, module
  buffers and grad-output buffers, the arena, the persistent sets). Any other 0-dim tensor an aten
  op reads is a CPU scalar: the op is recorded with a copy of its value at that point of the
  capture, and an aten op that writes one is host work, run at capture and skipped at replay.
  Custom ops are never baked: their kernels read tensors through device pointers (a CPU tensor
  there is an error on a GPU, not a baked value). A 0-dim device tensor made outside those (a
  module buffer captured with the bare primitive) is baked unless registered with
  ``static_buffer``.
* **Geometry.** A kernel's arguments hold each tensor's data pointer, sizes and strides as they
  were at launch, so a tensor re-laid-out in place after capture (``t_``, ``as_strided_``,
  ``resize_`` within its bytes) is read and written with its captured layout at its captured
  address. The tape replays every op on the captured layout of the same storage; a tensor moved
  to another storage (``set_``, ``.data =``) raises, since the graph would keep memory that may
  have been freed.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mhc_cg.core.errors import GraphCaptureError, GraphReplayError
from mhc_cg.core.storage import own_version_alias, storage_bytes, storage_id
from mhc_cg.graphs.capture import Graph, GraphBackend, Pool
from mhc_cg.graphs.guard import CaptureGuardMode, user_source_line
from mhc_cg.graphs.static_inputs import static_storages

aten = torch.ops.aten

_UNINITIALISED_ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
                              aten.new_empty_strided}
_KIND_SKIP, _KIND_RUN, _KIND_COPY_OUT = "skip", "run", "copy_out"


@dataclass
class RecordedOp:
    """One op of the tape: ``func`` re-run on ``flat_args`` (unflattened with ``spec``)."""

    func: torch._ops.OpOverload
    flat_args: list[Any]
    spec: Any
    outputs: list[torch.Tensor]
    kind: str

    def replay(self, relaid: dict[int, torch.Tensor]) -> None:
        """``relaid``: id of a recorded tensor -> an alias with its captured layout, for those whose
        layout changed since capture."""
        if self.kind == _KIND_SKIP:
            return
        flat_args, outputs = self.flat_args, self.outputs
        if relaid:
            flat_args = [relaid.get(id(a), a) for a in flat_args]
            outputs = [relaid.get(id(o), o) for o in outputs]
        args, kwargs = tree_unflatten(flat_args, self.spec)
        result = self.func(*args, **kwargs)
        if self.func.namespace == "c10d":  # as at capture; a CUDA graph orders it on its stream
            wait_for_collective(result)
        if self.kind == _KIND_COPY_OUT:
            fresh = [r for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor)]
            for captured, new in zip(outputs, fresh):
                captured.copy_(new)


def _classify(func: torch._ops.OpOverload, written: list[torch.Tensor], outputs: list[torch.Tensor],
              fresh_outputs: bool) -> str:
    if torch.Tag.inplace_view in func.tags:
        return _KIND_SKIP
    if written:  # and new outputs besides (a custom op that writes a buffer and returns more)
        return _KIND_COPY_OUT if outputs and fresh_outputs else _KIND_RUN
    if func.overloadpacket in _UNINITIALISED_ALLOCATIONS or not outputs:
        return _KIND_SKIP
    returns_alias = any(r.alias_info is not None for r in func._schema.returns)
    if returns_alias or not fresh_outputs:
        return _KIND_SKIP  # a view: it aliases storage the tape already replays
    return _KIND_COPY_OUT


class _TapeRecorder(CaptureGuardMode):
    """The guard, plus a record of every op that ran."""

    def __init__(self, graph_name: str):
        super().__init__(graph_name, keep_tensors=True)  # a replay needs every tensor it recorded
        self.ops: list[RecordedOp] = []
        # storages a GPU run keeps on the device, besides what this capture allocates
        self.on_device = static_storages()
        # storage id -> (the storage, its bytes before the capture first wrote it)
        self._untouched: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def before_op(self, func, args, kwargs, written):
        if torch.Tag.inplace_view in func.tags:
            for t in written:
                self._freeze_earlier_references(t)
        for t in written:  # Note [a capture runs nothing]
            key = storage_id(t)
            if key not in self._untouched and not self.book.is_owned(t) \
                    and not self._host_scalar(t):
                storage = t.untyped_storage()
                self._untouched[key] = (storage, storage.clone())

    def put_back(self) -> None:
        """Note [a capture runs nothing]: a CUDA capture records kernels and runs none, so the
        memory outside its pool is as it was before; the tape runs the body to record it, and
        puts back every storage the body wrote but did not allocate (gradient buffers, arena
        slots, static buffers). Host work (a host scalar written) runs at a GPU capture too and
        stays."""
        with torch.no_grad():
            for storage, before in self._untouched.values():
                storage.copy_(before)
        self._untouched.clear()

    def _freeze_earlier_references(self, t: torch.Tensor) -> None:
        """Ops recorded so far saw ``t`` with its current metadata; keep that for their replay."""
        frozen = None
        for op in self.ops:
            for i, a in enumerate(op.flat_args):
                if a is t:
                    frozen = frozen if frozen is not None else own_version_alias(t)
                    op.flat_args[i] = frozen
            for i, o in enumerate(op.outputs):
                if o is t:
                    frozen = frozen if frozen is not None else own_version_alias(t)
                    op.outputs[i] = frozen

    def record(self, func, args, kwargs, out, written, fresh_outputs):
        flat_args, spec = tree_flatten((args, kwargs))
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        kind = _classify(func, written, outputs, fresh_outputs)
        self.on_device.update(storage_id(a) for a in flat_args if isinstance(a, torch.nn.Parameter))
        if kind != _KIND_SKIP and func.namespace == "aten":
            if any(self._host_scalar(t) for t in written):
                kind = _KIND_SKIP  # host work: on a GPU it runs once, at capture
            else:  # its value now is what the launch would pass by value
                flat_args = [a.detach().clone() if self._host_scalar(a) else a for a in flat_args]
        self.ops.append(RecordedOp(func, flat_args, spec, outputs, kind))

    def _host_scalar(self, t: Any) -> bool:
        """``t`` is a 0-dim tensor a GPU run would keep on the host (see the module docstring)."""
        if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.device.type != "cpu":
            return False
        key = storage_id(t)
        return not (key in self.on_device or self.book.is_owned(t)
                    or any(key in graph.made_storages for graph in _CAPTURED))


_HOST_READ_METHODS = ("tolist", "numpy", "cpu")


@contextlib.contextmanager
def _host_read_traps(graph_name: str) -> Iterator[None]:
    """Make ``Tensor.tolist`` / ``numpy`` / ``cpu`` raise while capturing.

    On the CPU they read memory directly (``cpu()`` returns the tensor itself) and dispatch no op
    the tape could see; for a tensor on a GPU they are device-to-host copies that synchronise,
    which a graph cannot hold.
    """
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READ_METHODS}

    def trap(name: str):
        def reject(self, *args, **kwargs):
            raise GraphCaptureError(
                f"{graph_name}: Tensor.{name}() cannot be captured in a graph: it copies device "
                f"memory to the host and synchronises; a replay runs no Python that could read "
                f"it. At {user_source_line(__file__)}")
        return reject

    for name in _HOST_READ_METHODS:
        setattr(torch.Tensor, name, trap(name))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def wait_for_collective(out: Any) -> None:
    """Wait on the work handle a collective (a ``c10d::`` op) returned: a replay runs the
    collective and its completion together, as one launch."""
    for handle in tree_flatten(out)[0]:
        if hasattr(handle, "wait") and not isinstance(handle, torch.Tensor):
            handle.wait()


@contextlib.contextmanager
def collective_waits_unseen() -> Iterator[None]:
    """Inside: a collective's ``Work.wait()`` runs with the capture's dispatch mode off.

    What a backend runs when a collective completes (gloo's reduce-scatter copies its result
    out of a buffer of its own) belongs to the collective: a replay of the ``c10d::`` op, waited
    on (:func:`wait_for_collective`), runs it again. Recorded as ops of their own, they would
    copy the capture's stale buffer over the replayed result.
    """
    try:
        from torch._C._distributed_c10d import Work
    except ImportError:  # torch built without distributed
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    original = Work.wait

    def wait(self, *args, **kwargs):
        with _disable_current_modes():
            return original(self, *args, **kwargs)

    Work.wait = wait
    try:
        yield
    finally:
        Work.wait = original


class TapePool(Pool):
    """A pool of tape graphs: they keep their tensors alive and share one replay order.

    Outputs a graph released to the pool (:meth:`Graph.release_outputs`) stay allocated on the
    tape, but every replay of another graph of the pool first poisons them (NaN, or the dtype's
    minimum): on a GPU that graph may have been handed their memory, so a late reader is caught.
    """

    kind = "tape"

    def __init__(self, number: int, private: bool = False, independent: bool = False):
        super().__init__(number, private, independent)
        self.released: dict["TapeGraph", list[torch.Tensor]] = {}
        self._fresh: "TapeGraph | None" = None  # the graph whose released outputs are unpoisoned

    def release(self, owner: "TapeGraph", t: torch.Tensor) -> None:
        self.released.setdefault(owner, []).append(t)

    def poison_released(self, replaying: "TapeGraph") -> None:
        """Before ``replaying`` runs: only the last graph replayed can have unpoisoned outputs."""
        fresh, self._fresh = self._fresh, replaying
        if fresh is None or fresh is replaying:
            return
        with torch.no_grad():
            for t in self.released.get(fresh, ()):
                t.fill_(float("nan") if t.is_floating_point() or t.is_complex()
                        else (False if t.dtype == torch.bool else torch.iinfo(t.dtype).min))


class TapeGraph(Graph):
    """A recorded op sequence; see the module docstring."""

    def __init__(self, pool: TapePool):
        super().__init__(pool)
        self.ops: list[RecordedOp] = []
        self._storages: list[tuple[torch.Tensor, int, int, bool]] = []
        self._layouts: list[_Layout] = []

    def __repr__(self) -> str:
        return f"<{self.name}: {len(self.ops)} ops, {self._state}>"

    def external_reads(self) -> dict[int, int]:
        return storage_bytes([t for op in self.ops for t in op.flat_args
                              if isinstance(t, torch.Tensor)], self.made_storages)

    @contextlib.contextmanager
    def _record(self) -> Iterator[None]:
        recorder = _TapeRecorder(self.name)
        try:
            with _host_read_traps(self.name), collective_waits_unseen(), recorder:
                yield
        finally:
            recorder.put_back()
        self.stats = recorder.finish()
        _regrow_freed(recorder.book)
        self.made_storages = recorder.made_storages()
        self.ops = recorder.ops
        self.stats.ops_replayed = sum(op.kind != _KIND_SKIP for op in self.ops)
        self._storages = [(s.holder, s.nbytes, s.data_ptr, s.owned)
                          for s in recorder.book.storages.values()]
        self._layouts = _layouts(self.ops)
        _CAPTURED.add(self)

    def _replay(self) -> None:
        for holder, nbytes, data_ptr, owned in self._storages:
            storage = holder.untyped_storage()
            if storage.nbytes() != nbytes or storage.data_ptr() != data_ptr:
                raise GraphReplayError(
                    f"{self.name}: the storage of {'a tensor of the graph' if owned else 'an input'} "
                    f"{list(holder.shape)} {holder.dtype} was resized or freed since capture ({nbytes} bytes at {data_ptr:#x} -> "
                    f"{storage.nbytes()} at {storage.data_ptr():#x}); a CUDA graph would read "
                    f"and write the stale address")
        relaid = self._relaid()
        self.pool.poison_released(self)
        with torch.no_grad():
            for op in self.ops:
                op.replay(relaid)

    def _relaid(self) -> dict[int, torch.Tensor]:
        """Aliases with the captured layout of the tensors whose layout changed since capture."""
        relaid = {}
        for t, storage, data_ptr, size, stride, offset in self._layouts:
            if t.data_ptr() == data_ptr and t.size() == size and t.stride() == stride:
                continue
            if storage_id(t) != storage._cdata:
                raise GraphReplayError(
                    f"{self.name}: a tensor the graph reads or writes ({list(size)} {t.dtype}) was "
                    f"moved to another storage since capture (set_, .data =); a CUDA graph keeps "
                    f"using the old address, which may have been freed")
            relaid[id(t)] = own_version_alias(t, offset, size, stride)  # t's storage, checked above
        return relaid

    def _release(self, t: torch.Tensor) -> torch.Tensor:
        self.pool.release(self, t)
        return t


def _regrow_freed(book) -> None:
    """Give a storage the capture freed and left freed its bytes back, for the replay to write.

    On a GPU its memory went back to the graph's pool, which holds it for good, and a replay
    writes there in the captured order (Note [a capture frees and re-allocates its own storages]).
    """
    for state in book.storages.values():
        storage = state.storage()
        if state.owned and storage is not None and storage.nbytes() < state.peak_nbytes:
            storage.resize_(state.peak_nbytes)
            state.refresh()


# A tensor's identity and what a launch froze of it: storage, data pointer, sizes, strides, offset.
_Layout = tuple[torch.Tensor, torch.UntypedStorage, int, torch.Size, tuple[int, ...], int]


def _layouts(ops: list[RecordedOp]) -> list[_Layout]:
    """The layout at the end of the capture of every tensor a replayed op reads or writes.

    Final, not per op: a tensor re-laid-out during the capture (``t_`` of a graph tensor) is
    already swapped for a frozen alias in the ops recorded before the change.
    """
    found: dict[int, _Layout] = {}
    for op in ops:
        if op.kind == _KIND_SKIP:
            continue
        for t in itertools.chain(op.flat_args, op.outputs):
            if isinstance(t, torch.Tensor) and id(t) not in found:
                found[id(t)] = (t, t.untyped_storage(), t.data_ptr(), t.size(), t.stride(),
                                t.storage_offset())
    return list(found.values())


# Every captured tape graph still alive: what they allocated is device memory to later captures.
_CAPTURED: "weakref.WeakSet[TapeGraph]" = weakref.WeakSet()


class TapeBackend(GraphBackend):
    """CPU graphs: :class:`TapeGraph` on :class:`TapePool`."""

    name = "tape"
    device = "cpu"
    pool_type = TapePool
    graph_type = TapeGraph
