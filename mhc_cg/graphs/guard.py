"""The capture guard: what a CUDA graph cannot hold, checked on every aten op of a capture.

Every backend captures under :class:`CaptureGuardMode`, a ``TorchDispatchMode`` that sees each op
(autograd's backward ops included) before it runs. It is what makes CPU testing honest: the tape
refuses exactly what a real capture would refuse, with the op and the user's source line.

* **Static addresses.** A replay reads and writes exactly the storages the capture saw. Code that
  frees, resizes or re-points a storage the graph uses but did not allocate
  (``untyped_storage().resize_``, ``set_``, ``.data =``) is rejected (:class:`AddressBook`,
  :class:`CaptureSafetyReport`); one it allocated may be freed and allocated again
  (Note [a capture frees and re-allocates its own storages]).
* **No host synchronisation, no data-dependent shapes** (``.item()``, ``nonzero``, ``unique``,
  boolean-mask indexing but ``x[mask] = scalar``, which is a masked fill, device-to-host copies,
  ``torch.tensor([...])`` from Python data), and
  no 0-dim CPU tensor read by a device op (CUDA bakes its value in at capture):
  :func:`illegal_op_reason`.
* **No stateful random ops**: use the counter dropout of :mod:`mhc_cg.ops.dropout`.

The guard pins nothing unless asked (``keep_tensors``, which only the tape needs): it tracks
storages through weak references, so a capture holds on the device what the driver's graph
alone would hold, and temporaries the body drops go back to the pool during the capture.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                         _get_current_dispatch_mode_stack)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from mhc_cg.core.errors import GraphCaptureError
from mhc_cg.core.storage import storage_id

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------
# Where the user's code is: the first frame outside torch, contextlib and this package.

_SKIPPED_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,)
_SKIPPED_FILES = (contextlib.__file__,)


def user_source_line(*backend_files: str) -> str:
    """``file:line in function: source`` of the innermost frame that is the user's code: not
    torch's, not this package's, nor a backend's own ``backend_files``."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_SKIPPED_DIRS) or filename in _SKIPPED_FILES
                or filename in backend_files or filename.startswith("<")):
            source = linecache.getline(filename, frame.f_lineno).strip()
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}: {source}"
        frame = frame.f_back
    return "<no frame outside torch and mhc_cg.graphs>"


# --------------------------------------------------------------------------------------------
# Which ops a graph cannot hold.

_HOST_SYNC_OPS = {aten._local_scalar_dense, aten.equal, aten.is_nonzero}
_DATA_DEPENDENT_SHAPE_OPS = {
    aten.nonzero, aten.masked_select, aten.unique_dim, aten.unique_consecutive, aten._unique,
    aten._unique2, aten.unique_dim_consecutive, aten.bincount, aten.repeat_interleave,
}
_STORAGE_REPOINTING_OPS = {aten.set_, aten.resize_, aten.resize_as_}
_COUNTER_DROPOUT_HINT = (
    "use mhc_cg.ops.dropout.dropout(x, p, training, impl='counter', seed=<int64 seed tensor>, "
    "stream=<call-site id>): its mask is a pure function of a seed tensor, so every replay and "
    "every recompute draws the same mask. A CUDA graph replays a stateful generator's Philox "
    "offsets correctly only for generators registered with the graph, and a recompute graph "
    "cannot redraw the forward's mask; the CPU tape cannot rewind the CPU generator at all")


def as_masked_fill(func: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """Note [x[mask] = scalar is a masked fill]: ATen runs ``index_put_`` with one boolean mask,
    a one-element host value and no accumulation as ``masked_fill_`` on every device, the value
    read on the host (and autograd's ``index_put`` backward of it as ``masked_fill``): fixed
    shapes, which a CUDA graph captures, and a replay follows the mask's new contents.
    ``(masked_fill op, args, kwargs)`` for such a call, else ``None``; any other boolean indexing
    stays refused (:func:`illegal_op_reason`)."""
    if func not in (aten.index_put_.default, aten.index_put.default):
        return None
    self, indices, value = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    defined = [i for i in indices if i is not None]
    if accumulate or value.numel() != 1 or value.device.type != "cpu" or len(defined) != 1:
        return None
    mask = defined[0]
    if mask.dtype not in (torch.bool, torch.uint8) or mask.device != self.device:
        return None
    leading = next(k for k, i in enumerate(indices) if i is not None)
    if any(i is not None for i in indices[leading + 1:]):
        return None
    with _disable_current_modes():  # host work, as ATen's value.item() on a host scalar
        fill = value.item()
        mask = mask.view(*mask.shape, *([1] * (self.dim() - leading - mask.dim()))).bool()
    fill_op = aten.masked_fill_.Scalar if func is aten.index_put_.default \
        else aten.masked_fill.Scalar
    return fill_op, (self, mask, fill), {}


def illegal_op_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why ``func`` cannot be captured, or ``None`` when it can."""
    packet = func.overloadpacket
    if packet in _HOST_SYNC_OPS:
        return ("it copies a device value to the host and synchronises (.item(), .tolist(), "
                "bool(tensor), torch.equal); a graph replay runs no Python that could read it")
    if packet in _DATA_DEPENDENT_SHAPE_OPS:
        if packet is aten.repeat_interleave and (
                func._overloadname == "self_int"
                or _argument(func, "output_size", args, kwargs) is not None):
            return None  # repeats known on the host, or the output size given: a fixed shape
        return "its output shape depends on tensor values; a graph needs shapes fixed at capture"
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) \
            and _has_bool_index(func, args, kwargs):
        return ("it indexes with a boolean mask (x[mask], or x[mask] = v with v more than one "
                "value), which hides a nonzero: the selected count depends on tensor values; use "
                "torch.where(mask, v, x) or x * mask, which keep shapes fixed (x[mask] = scalar "
                "is a masked fill and is captured)")
    if packet in (aten.lift_fresh, aten.lift_fresh_copy) and args and args[0].dim() > 0:
        return ("it makes a tensor from Python data (torch.tensor([...])); on a GPU that is a "
                "copy from pageable host memory, which a capture refuses; build it before the "
                "capture, or on the device (torch.arange, torch.full)")
    if torch.Tag.nondeterministic_seeded in func.tags and _draws_random(func, args, kwargs):
        return f"it draws from a stateful random generator; {_COUNTER_DROPOUT_HINT}"
    if packet not in _HOST_SCALAR_OK_OPS and _mixes_host_scalar(args, kwargs):
        return ("it reads a 0-dim CPU tensor together with device tensors: a CUDA kernel takes "
                "its value once, at capture, and every replay keeps that value; put the tensor "
                "on the device (a static buffer the graph reads at replay)")
    if packet in (aten._to_copy, aten.copy_):
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        target = kwargs.get("device") if packet is aten._to_copy else (args[0].device if args else None)
        sources = flat if packet is aten._to_copy else flat[1:2]
        if target is not None and torch.device(target).type == "cpu" and any(
                s.device.type != "cpu" for s in sources):
            return "it copies device memory to the host, which synchronises the stream"
    return None


# A 0-dim CPU value of these is a wrapped Python number (x[i] = 1.0, x.fill_(t)): fine in a graph.
_HOST_SCALAR_OK_OPS = {aten.index_put_, aten.index_put, aten.fill_, aten.fill, aten.lift_fresh,
                       aten.lift_fresh_copy}


def _has_bool_index(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    try:
        indices = _argument(func, "indices", args, kwargs)
    except KeyError:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _mixes_host_scalar(args: tuple, kwargs: dict) -> bool:
    """A 0-dim CPU tensor among the arguments of an op on device (non-CPU) tensors."""
    flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    on_device = any(t.device.type not in ("cpu", "meta") for t in flat)
    return on_device and any(t.device.type == "cpu" and t.dim() == 0 for t in flat)


def _argument(func: torch._ops.OpOverload, name: str, args: tuple, kwargs: dict) -> Any:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[i] if i < len(args) and not arg.kwarg_only else arg.default_value
    raise KeyError(name)


def _draws_random(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Attention kernels are tagged as seeded for their ``dropout_p``; at 0 they draw nothing."""
    try:
        return _argument(func, "dropout_p", args, kwargs) not in (0, 0.0, None)
    except KeyError:
        return True


# --------------------------------------------------------------------------------------------
# Static-address bookkeeping.

@dataclass
class CaptureSafetyReport:
    """What one capture touched, and every address rule it broke.

    ``external_*`` are storages the graph read or wrote but did not allocate (its inputs,
    parameters, buffers made before the capture); ``owned_storages`` were allocated by ops of
    the capture and belong to the graph's pool. ``resized_storages`` lists storages whose size or
    address changed while the graph held them; ``repointed_tensors`` tensors that were moved to
    another storage. Both are empty after every successful capture: a violation raises
    :class:`GraphCaptureError` carrying this report.
    """

    ops_seen: int = 0
    ops_replayed: int = 0
    owned_storages: int = 0
    external_storages: int = 0
    tensors_tracked: int = 0
    escaped_storages: int | None = None  # owned storages alive after the capture (weak book only)
    escaped_bytes: int | None = None
    resized_storages: list[str] = field(default_factory=list)
    repointed_tensors: list[str] = field(default_factory=list)

    @property
    def violations(self) -> int:
        return len(self.resized_storages) + len(self.repointed_tensors)


def _describe(t: torch.Tensor) -> str:
    return f"tensor(shape={list(t.shape)}, dtype={t.dtype}, device={t.device})"


class _StorageState:
    """One storage the capture used: its size and address when first seen, and who allocated it.

    ``strong``: ``holder`` keeps the storage alive (the tape replays it, so it must). Otherwise only
    a weak reference is kept (``ref``): the capture then holds on the device exactly what the
    driver's graph holds, and a storage the body drops returns to the pool as it would without the
    guard. The weak reference also keeps the storage object's address (:func:`storage_id`) from
    being reused while the book lives, so keys stay unique.
    """

    __slots__ = ("holder", "ref", "nbytes", "peak_nbytes", "data_ptr", "owned", "first_seen",
                 "description")

    def __init__(self, holder: torch.Tensor, owned: bool, first_seen: str, strong: bool = True):
        storage = holder.untyped_storage()
        self.holder = holder if strong else None
        self.ref = None if strong else StorageWeakRef(storage)
        self.nbytes = self.peak_nbytes = storage.nbytes()
        self.data_ptr = storage.data_ptr()
        self.owned = owned
        self.first_seen = first_seen
        self.description = _describe(holder)

    def storage(self) -> torch.UntypedStorage | None:
        """The storage, or ``None`` once it was freed (weak references only)."""
        if self.holder is not None:
            return self.holder.untyped_storage()
        return torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)

    def alive(self) -> bool:
        return self.holder is not None or not self.ref.expired()

    def changed(self) -> bool:
        storage = self.storage()
        return storage is not None and (storage.nbytes() != self.nbytes
                                        or storage.data_ptr() != self.data_ptr)

    def refresh(self) -> None:
        storage = self.storage()
        if storage is not None:
            self.nbytes, self.data_ptr = storage.nbytes(), storage.data_ptr()
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    def current(self) -> str:
        storage = self.storage()
        if storage is None:
            return "freed"
        return f"{storage.nbytes()} bytes at {storage.data_ptr():#x}"


class AddressBook:
    """Every tensor and storage a capture used, with the address each had when first seen.

    A storage is *owned* when an op of the capture allocated it; an owned storage may be resized
    or re-pointed by a recorded op (e.g. an ``out=`` kernel sizing its fresh output), and the book
    follows it. A storage the graph did not allocate must keep its size and address from the first
    op that touched it to the end of the capture, and across replays.
    """

    def __init__(self, strong: bool = True) -> None:
        self.strong = strong
        self.storages: dict[int, _StorageState] = {}
        # id(tensor) -> (tensor, or a weak reference to it, storage key)
        self.tensor_storage: dict[int, tuple[Any, int]] = {}

    def _tensor_entry(self, t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        entry = self.tensor_storage.get(id(t))
        if entry is None:
            return None
        held, key = entry
        tensor = held if self.strong else held()
        return (tensor, key) if tensor is t else None  # a dead tensor's id may be reused

    def _tensor_entries(self) -> list[tuple[torch.Tensor, int]]:
        if self.strong:
            return list(self.tensor_storage.values())
        entries = [(ref(), key) for ref, key in self.tensor_storage.values()]
        return [(t, key) for t, key in entries if t is not None]

    def is_owned(self, t: torch.Tensor) -> bool:
        state = self.storages.get(storage_id(t))
        return state is not None and state.owned

    def knows_storage(self, t: torch.Tensor) -> bool:
        return storage_id(t) in self.storages

    def track(self, t: torch.Tensor, owned: bool, where: str) -> None:
        key = storage_id(t)
        if key not in self.storages:
            self.storages[key] = _StorageState(t, owned, where, self.strong)
        if self._tensor_entry(t) is None:
            self.tensor_storage[id(t)] = (t if self.strong else weakref.ref(t), key)

    def refresh(self, t: torch.Tensor, where: str) -> None:
        """After a recorded op resized or re-pointed a tensor the graph owns: follow it.

        A storage first met this way (``set_`` onto a storage made before the capture, like an
        arena slot) is not the graph's: its address must stay fixed from now on.
        """
        key = storage_id(t)
        self.tensor_storage[id(t)] = (t if self.strong else weakref.ref(t), key)
        state = self.storages.get(key)
        if state is None:
            self.storages[key] = _StorageState(t, False, where, self.strong)
        else:
            state.refresh()

    def violations_of(self, tensors: list[torch.Tensor] | None = None) -> tuple[list[str], list[str]]:
        """``(resized storages, re-pointed tensors)`` among ``tensors`` (default: all tracked).

        Note [a capture frees and re-allocates its own storages]: a storage the capture allocated
        may be freed and allocated again outside any op (``untyped_storage().resize_``, as an
        eager recompute does inside a full-iteration capture): its memory is the graph's pool's,
        so a replay finds it where the capture left it, and the book follows it. Only a storage
        the graph did not allocate must keep its size and address."""
        if tensors is None:
            entries = self._tensor_entries()
            storages = list(self.storages.values())
        else:
            entries = [e for e in map(self._tensor_entry, tensors) if e is not None]
            storages = [self.storages[key] for _, key in entries]
        resized = []
        for s in {id(s): s for s in storages}.values():
            if not s.changed():
                continue
            if s.owned:
                s.refresh()
            else:
                resized.append(f"{s.description} first used at {s.first_seen}: storage "
                               f"size/address changed from {s.nbytes} bytes at {s.data_ptr:#x} "
                               f"to {s.current()}, and the graph did not allocate it")
        repointed = [f"{_describe(t)}: moved to another storage (set_ or .data =) after the "
                     f"graph first used it at {self.storages[key].first_seen}"
                     for t, key in entries if storage_id(t) != key]
        return resized, repointed


def capture_guard_active() -> bool:
    """A :class:`CaptureGuardMode` is on the dispatch mode stack: a capture is running."""
    return any(isinstance(mode, CaptureGuardMode) for mode in _get_current_dispatch_mode_stack())


class CaptureGuardMode(TorchDispatchMode):
    """Rejects graph-illegal ops at capture and tracks every storage the capture touches.

    Subclasses hook :meth:`record` to keep the ops (the tape does; the CUDA backend only checks).
    Errors name the op and the user's source line (:func:`user_source_line`).
    """

    def __init__(self, graph_name: str, keep_tensors: bool = False):
        super().__init__()
        self.graph_name = graph_name
        # keep_tensors: hold every tensor the capture touched (the tape must, to replay them);
        # otherwise the guard pins nothing and the capture holds what the driver's graph holds
        self.book = AddressBook(strong=keep_tensors)
        self.report = CaptureSafetyReport()

    def _user_line(self) -> str:
        # a backend's own subclass (the tape's) sits between the user's op and this guard
        return user_source_line(sys.modules[type(self).__module__].__file__)

    def _fail(self, message: str) -> None:
        resized, repointed = self.book.violations_of()
        self.report.resized_storages, self.report.repointed_tensors = resized, repointed
        raise GraphCaptureError(f"{self.graph_name}: {message}", self.report)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.report.ops_seen += 1
        masked_fill = as_masked_fill(func, args, kwargs)  # Note [x[mask] = scalar is a masked fill]
        if masked_fill is not None:
            func, args, kwargs = masked_fill
        reason = illegal_op_reason(func, args, kwargs)
        if reason is not None:
            self._fail(f"op {func} cannot be captured in a graph: {reason}. "
                       f"At {self._user_line()}")
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        where = f"{func} at {self._user_line()}"
        resized, repointed = self.book.violations_of(flat_in)
        if resized or repointed:
            self._fail(f"a tensor used by op {func} changed address outside any op the graph "
                       f"can see (untyped_storage().resize_, .data =); a replay would use the "
                       f"old address. At {self._user_line()}. " + "; ".join(resized + repointed))
        written = _written_args(func, args, kwargs)
        if func.overloadpacket in _STORAGE_REPOINTING_OPS:
            for t in written:
                if not self.book.is_owned(t):
                    self._fail(f"op {func} would resize or re-point the storage of "
                               f"{_describe(t)}, which the graph did not allocate; a replay keeps "
                               f"reading and writing the old address. At {self._user_line()}")
        for t in flat_in:
            self.book.track(t, owned=False, where=where)
        owned_written = [t for t in written if self.book.is_owned(t)]
        self.before_op(func, args, kwargs, written)
        out = func(*args, **kwargs)
        flat_out = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        for t in owned_written:
            self.book.refresh(t, where)
        resized, repointed = self.book.violations_of(
            [t for t in written if all(t is not o for o in owned_written)])
        if resized or repointed:
            self._fail(f"op {func} resized or re-pointed a storage the graph did not allocate "
                       f"(an out= tensor of the wrong size?). At {self._user_line()}. "
                       + "; ".join(resized + repointed))
        fresh = [o for o in flat_out if not self.book.knows_storage(o)]
        for o in flat_out:
            self.book.track(o, owned=True, where=where)
        self.record(func, args, kwargs, out, written, fresh_outputs=len(fresh) == len(flat_out))
        return out

    def before_op(self, func, args: tuple, kwargs: dict, written: list[torch.Tensor]) -> None:
        """Called after the checks, before ``func`` runs. Default: nothing."""

    def record(self, func, args: tuple, kwargs: dict, out: Any, written: list[torch.Tensor],
               fresh_outputs: bool) -> None:
        """Called after ``func`` ran. ``fresh_outputs``: every tensor output has a new storage."""

    def made_storages(self) -> set[int]:
        """Storage ids of what the capture allocated (valid while those storages live)."""
        return {key for key, s in self.book.storages.items() if s.owned}

    def finish(self) -> CaptureSafetyReport:
        """End-of-capture check over every tracked tensor; returns the report."""
        resized, repointed = self.book.violations_of()
        if resized or repointed:
            self._fail("storages the graph uses were resized or re-pointed during capture "
                       "(untyped_storage().resize_, set_, .data =): " + "; ".join(resized + repointed))
        self.report.owned_storages = sum(s.owned for s in self.book.storages.values())
        self.report.external_storages = len(self.book.storages) - self.report.owned_storages
        self.report.tensors_tracked = len(self.book.tensor_storage)
        if not self.book.strong:
            escaped = [s for s in self.book.storages.values() if s.owned and s.alive()]
            self.report.escaped_storages = len(escaped)
            self.report.escaped_bytes = sum(s.nbytes for s in escaped)
        return self.report


def _written_args(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func``'s schema marks as written (``Tensor(a!)``).

    A collective (``c10d::``: all-gather, reduce-scatter, all-reduce, all-to-all, broadcast,
    receive) writes its first argument, which its schema does not mark; a send reads it, which
    counts here as a write too (a graph must run it again either way).
    """
    if func.namespace == "c10d" and args:
        return [v for v in tree_flatten(args[0])[0] if isinstance(v, torch.Tensor)]
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        written.extend(v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor))
    return written
