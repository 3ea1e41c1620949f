"""Recording what ops cost: kernels and bytes of an op stream, and the blocks a capture allocates.

:class:`OpCounter` counts kernels (:func:`mhc_cg.lab.cost.ops.launches_kernel`) and their bytes.
:class:`CaptureRecorder` is the capture guard with a counter and a block table: it sees exactly
the ops a capture records, checks them like every backend does, keeps only weak references, and
hands the blocks to the pool's allocator emulation (:mod:`mhc_cg.lab.cost.allocator`).
:class:`StepRecorder` counts one training step: the eager ops it dispatches, plus every graph
replayed inside it (a replay dispatches nothing; the recording backend adds the graph's cost).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mhc_cg.lab.cost.fused import NOT_MHC
from mhc_cg.lab.cost.allocator import Block, PoolState, rounded
from mhc_cg.core import regions
from mhc_cg.lab.cost.ops import (is_gemm, kernel_launches, launches_kernel, op_bytes,
                                   op_flops)
from mhc_cg.lab.cost.step_model import Band, StepModel
from mhc_cg.graphs.guard import CaptureGuardMode
from mhc_cg.core.storage import storage_id


@dataclass
class OpCounter:
    """Kernels, bytes and FLOPs of the ops seen; ``by_op`` counts kernels per op name.

    ``by_part`` splits the bytes by ``(phase, part)`` (:func:`part_of`), ``by_phase`` the kernels
    by phase (``other`` outside any); ``model_seconds`` sums each kernel's time on ``model``'s
    GPU (:meth:`~mhc_cg.lab.cost.step_model.StepModel.kernel_seconds`, a band); without a model,
    nothing is timed.
    """

    model: StepModel | None = None
    kernels: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    ops: int = 0
    flops: int = 0
    model_seconds: Band = Band()
    bandwidth_seconds: Band = Band()  # of model_seconds: kernels bound by their bytes
    by_op: Counter = field(default_factory=Counter)
    by_part: Counter = field(default_factory=Counter)
    by_phase: Counter = field(default_factory=Counter)
    seconds_by_phase: Counter = field(default_factory=Counter)
    bytes_by_op: Counter = field(default_factory=Counter)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def add(self, func, args: tuple, kwargs: dict, out: Any, streams: StreamTracker | None = None) -> None:
        self.ops += 1
        if not launches_kernel(func, args, kwargs, out):
            return
        read, written = op_bytes(func, args, kwargs, out)
        flops = op_flops(func, args, kwargs, out)
        launches = kernel_launches(func, args, kwargs)
        self.kernels += launches
        self.bytes_read += read
        self.bytes_written += written
        self.flops += flops
        if self.model is None:
            seconds = Band()
        else:
            moving, computing = self.model.kernel_seconds(func._schema.name, read + written, flops)
            self.bandwidth_seconds += moving
            seconds = moving + computing
        self.model_seconds += seconds
        self.by_op[str(func.overloadpacket)] += launches
        self.bytes_by_op[str(func.overloadpacket)] += read + written
        phase = regions.current_phase() or "other"
        self.by_phase[phase] += launches
        self.seconds_by_phase[phase] += seconds
        self.by_part[(phase, part_of(func, args, kwargs, out, streams))] += read + written

    def add_counter(self, other: "OpCounter") -> None:
        self.kernels += other.kernels
        self.bytes_read += other.bytes_read
        self.bytes_written += other.bytes_written
        self.ops += other.ops
        self.flops += other.flops
        self.model_seconds += other.model_seconds
        self.bandwidth_seconds += other.bandwidth_seconds
        self.by_op.update(other.by_op)
        self.by_part.update(other.by_part)
        self.by_phase.update(other.by_phase)
        self.seconds_by_phase.update(other.seconds_by_phase)
        self.bytes_by_op.update(other.bytes_by_op)


# What a kernel's bytes are for. mHC traffic is the fused mHC ops plus every other op that touches
# a stream tensor (F never sees one); copies the runtime adds are named by the runtime.
MHC_PARTS = ("mHC ops", "n-stream GEMMs", "n-stream adds", "n-stream other")


class StreamTracker:
    """Which storages hold n-stream tensors (the residual streams, their gradients, the mapping
    projection's weight), by identity (a tensor with an ``n C`` dimension joins only through mHC
    work): width alone cannot tell (an MLP of 4C is as wide as 4
    streams of C). Work in an ``mhc`` region (:func:`mhc_cg.core.regions.region`) and the fused mHC ops seed the
    set; any op touching a member joins its ``width``-wide tensors to it, so the backward's ops
    (which no label reaches) are found through the tensors they read."""

    def __init__(self, width: int):
        self.width = width
        self._refs: dict[int, StorageWeakRef] = {}
        self._never: set[int] = set()

    def exclude(self, tensors: list[torch.Tensor]) -> None:
        """``tensors``' storages never join: the optimizer's flat buffers hold every parameter
        and gradient, the mapping projection's among them, and all the rest."""
        self._never |= {storage_id(t) for t in tensors}

    def _wide(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # any dimension: the projection's weight is read transposed in the forward
        return [t for t in tensors if self.width in t.shape]

    def _member(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(storage_id(t))
        return ref is not None and not ref.expired()

    def classify(self, func, args: tuple, kwargs: dict, out: Any) -> str | None:
        """The op's mHC part, or ``None`` when it touches no stream."""
        wide = self._wide(_tensors((args, kwargs, out)))
        custom = getattr(func, "namespace", "") == "mhc_cg" and func._schema.name not in NOT_MHC
        if not (custom or regions.in_mhc() or any(self._member(t) for t in wide)):
            return None
        for t in wide:
            if storage_id(t) not in self._never:
                self._refs[storage_id(t)] = StorageWeakRef(t.untyped_storage())
        if custom:
            return "mHC ops"
        if is_gemm(func):
            return "n-stream GEMMs"
        return "n-stream adds" if str(func.overloadpacket) in ("aten.add", "aten.add_") \
            else "n-stream other"


def part_of(func, args: tuple, kwargs: dict, out: Any, streams: StreamTracker | None) -> str:
    mhc = streams.classify(func, args, kwargs, out) if streams is not None else None  # tracks too
    copy = regions.current_copy()
    if copy is not None:
        return f"copy: {copy}"
    if regions.current_phase() == "optimizer":
        return "optimizer"
    return mhc or "F and the rest"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def owner(func, t: torch.Tensor) -> tuple:
    """What made a storage, for the peak's breakdown (:func:`owner_text` when reported): kept
    raw, as every op the cost model records makes some."""
    return func, tuple(t.shape), t.dtype


def owner_text(made: tuple | None) -> str:
    """``op [shape] dtype`` of an :func:`owner`."""
    if made is None:
        return "?"
    func, shape, dtype = made
    packet = str(func.overloadpacket)
    name = packet[5:] if packet.startswith("aten.") else packet.replace(".", "::", 1)
    return f"{name} {list(shape)} {str(dtype).removeprefix('torch.')}"


class CaptureRecorder(CaptureGuardMode):
    """The capture guard (weak references only), counting kernels and tracking the pool's blocks.

    ``pool`` is the :class:`PoolState` the capture allocates from: its resident blocks join the
    table at the start, and :meth:`settle` returns the capture's peaks.
    """

    def __init__(self, graph_name: str, pool: PoolState, streams: StreamTracker | None = None,
                 model: StepModel | None = None):
        super().__init__(graph_name, keep_tensors=False)
        self.pool = pool
        self.streams = streams
        self.counter = OpCounter(model)
        self.index = 0
        self.blocks: dict[int, Block] = {b.ref.cdata: b for b in pool.live_resident()}
        self._external: set[int] = set()
        self._live: list[Block] = list(self.blocks.values())
        self._retired: list[Block] = []  # blocks of storages freed in place and allocated again

    def _poll_frees(self, at: int) -> None:
        still = []
        for b in self._live:
            if b.alive():
                still.append(b)
            else:
                b.freed_at = at
        self._live = still

    def before_op(self, func, args, kwargs, written) -> None:
        self._poll_frees(self.index)

    def record(self, func, args, kwargs, out, written, fresh_outputs) -> None:
        i = self.index
        self.counter.add(func, args, kwargs, out, self.streams)
        for t in _tensors((args, kwargs, out)):
            key = storage_id(t)
            block = self.blocks.get(key)
            storage = t.untyped_storage()
            if block is not None and block.released and storage.nbytes() > 0:
                self._retired.append(block)  # allocated again: a new block of the pool
                block = self.blocks[key] = Block(StorageWeakRef(storage),
                                                 rounded(storage.nbytes()), i, i,
                                                 what=owner(func, t), graph=self.graph_name)
                self._live.append(block)
        for t in _tensors((args, kwargs)):
            key = storage_id(t)
            block = self.blocks.get(key)
            if block is not None:
                block.last_use = i
                block.nbytes = max(block.nbytes, rounded(t.untyped_storage().nbytes()))
            else:
                self._external.add(key)
        for t in _tensors(out):
            key = storage_id(t)
            block = self.blocks.get(key)
            storage = t.untyped_storage()
            if block is not None:
                block.last_use = i
                block.nbytes = max(block.nbytes, rounded(storage.nbytes()))
            elif key not in self._external and storage.nbytes() > 0:
                block = Block(StorageWeakRef(storage), rounded(storage.nbytes()), i, i,
                              what=owner(func, t), graph=self.graph_name)
                self.blocks[key] = block
                self._live.append(block)
        self.index += 1

    def settle(self):
        self._poll_frees(self.index)
        return self.pool.settle([*self._retired, *self.blocks.values()], self.index,
                                self.graph_name)


class LiveBytes:
    """What the eager ops of a step allocate, as the caching allocator sees it: a storage counts
    (in 512-byte blocks) from the op that makes it until Python drops it or shrinks it (a
    discarded checkpoint output is resized to nothing, and grows back when recomputed); ``peak``
    is the most alive after any op. A storage an op writes that was one of its inputs (in place,
    ``out=``, a view) is not new; storages allocated before the step (parameters, optimizer
    state, static buffers, graph pools) and what graph replays touch are not counted here.
    ``peak_by_phase`` is that most per phase of the step (:data:`mhc_cg.core.regions.PHASES`,
    ``None`` outside any): what is alive after an op of that phase, whoever allocated it."""

    def __init__(self) -> None:
        self._live: dict[int, list] = {}  # storage id -> [weak ref, bytes counted, owner]
        self.bytes = 0
        self.peak_by_phase: dict[str | None, int] = {}
        self.largest_by_phase: dict[str | None, int] = {}  # the largest storage made in a phase
        # what was alive at the step's most: (owner, bytes)
        self.live_at_peak: list[tuple[tuple | None, int]] = []

    @property
    def peak(self) -> int:
        return max(self.peak_by_phase.values(), default=0)

    def after_op(self, args: tuple, kwargs: dict, out: Any, func=None) -> None:
        for key, entry in list(self._live.items()):
            ref, counted, _ = entry
            now = 0 if ref.expired() else rounded(
                torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes())
            self.bytes += now - counted
            if ref.expired():
                del self._live[key]
            else:
                entry[1] = now
        inputs = {storage_id(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            key = storage_id(t)
            if key in inputs or key in self._live:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            nbytes = rounded(storage.nbytes())
            self._live[key] = [StorageWeakRef(storage), nbytes,
                               owner(func, t) if func is not None else None]
            self.bytes += nbytes
            made = regions.current_phase()
            self.largest_by_phase[made] = max(self.largest_by_phase.get(made, 0), nbytes)
        phase = regions.current_phase()
        if self.bytes > self.peak:  # what made each, formatted when reported
            self.live_at_peak = [(o, n) for _, n, o in self._live.values() if n]
        self.peak_by_phase[phase] = max(self.peak_by_phase.get(phase, 0), self.bytes)


class StepRecorder(TorchDispatchMode):
    """Counts a training step: eager ops through dispatch, graph replays through :meth:`replayed`.

    ``eager`` and ``graphs`` split the total (timed by ``model``); ``replays`` counts graph
    launches; ``live`` tracks what the eager ops allocate (:class:`LiveBytes`). With ``device`` other than the CPU, an op
    that touches no tensor off the CPU is host work (AdamW's step counter and its ``item()``):
    no kernel, no device memory (``host_ops`` counts those a CPU run would charge as kernels).
    """

    def __init__(self, streams: StreamTracker | None = None,
                 device: torch.device | str | None = None, model: StepModel | None = None) -> None:
        super().__init__()
        self.eager = OpCounter(model)
        self.graphs = OpCounter(model)
        self.replays = 0
        self.replays_by_phase: Counter = Counter()  # the phase each replay was launched in
        self.streams = streams
        self.live = LiveBytes()
        self.host_ops = 0
        self._host_only = device is not None and torch.device(device).type != "cpu"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._host_only and all(t.device.type == "cpu" for t in _tensors((args, kwargs, out))):
            self.host_ops += launches_kernel(func, args, kwargs, out)
            return out
        self.eager.add(func, args, kwargs, out, self.streams)
        self.live.after_op(args, kwargs, out, func)
        return out

    def replayed(self, cost: OpCounter) -> None:
        self.replays += 1
        self.replays_by_phase[regions.current_phase() or "other"] += 1
        self.graphs.add_counter(cost)

    @property
    def kernels(self) -> int:
        return self.eager.kernels + self.graphs.kernels

    @property
    def kernels_by_phase(self) -> Counter:
        return self.eager.by_phase + self.graphs.by_phase

    @property
    def bytes(self) -> int:
        return self.eager.bytes + self.graphs.bytes

    @property
    def by_part(self) -> Counter:
        return self.eager.by_part + self.graphs.by_part
