"""The capture primitive every graph backend provides: pools, graphs and their replay order.

A *backend* makes *pools* and *graphs*::

    backend = get_backend("tape" | "cuda" | "te" | "auto")   # mhc_cg.lab.emulation.backends
    pool = backend.new_pool()             # opaque; graphs that share it share memory
    graph = backend.new_graph(pool=pool)  # pool=None: a private pool for this graph alone
    with graph.capture():                 # runs the body once, recording its device work
        ...
    graph.replay()                        # re-runs the recorded work on the recorded tensors

Every capture runs under :class:`~mhc_cg.graphs.guard.CaptureGuardMode`, which rejects what a
CUDA graph cannot hold. Graphs of one pool replay in the order they were captured
(:class:`PoolOrder`): a shared pool lets a later graph reuse the memory an earlier graph freed,
which is only sound in capture order. TransformerEngine leaves a violation silent; we raise.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from abc import ABC, abstractmethod
from typing import Any, ContextManager, Iterator

import torch

from mhc_cg.core.errors import GraphCaptureError, GraphReplayError
from mhc_cg.graphs.guard import CaptureSafetyReport, capture_guard_active
from mhc_cg.core.storage import storage_id

def graph_capturing() -> bool:
    """Whether a graph capture is running: one of mhc_cg's backends (each captures under its
    :class:`~mhc_cg.graphs.guard.CaptureGuardMode`, found on the dispatch mode stack), or
    a CUDA stream capture (TransformerEngine's ``make_graphed_callables``, ``torch.cuda.graph``).
    Warm-up runs of the same callables are not captures."""
    if capture_guard_active():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------------------------
# Pools and their replay order.

class PoolOrder:
    """The capture sequence of the graphs sharing one pool, and a replay cursor.

    Replays must follow the capture sequence; after the last graph the cursor wraps to the first
    (the next iteration). A capture appends to the sequence and rewinds the cursor. ``strict=False``
    (a pool of independent graphs) allows any order.
    """

    def __init__(self, name: str, strict: bool = True):
        self.name = name
        self.strict = strict
        self.sequence: list[Any] = []
        self.cursor = 0

    def captured(self, graph: Any) -> None:
        self.sequence.append(graph)
        self.cursor = 0

    def check_replay(self, graph: Any) -> None:
        if not self.sequence:
            raise GraphReplayError(f"{self.name}: replay of a graph that was never captured")
        if not self.strict:
            return
        expected = self.sequence[self.cursor]
        if graph is not expected:
            position = next((i for i, g in enumerate(self.sequence) if g is graph), None)
            raise GraphReplayError(
                f"{self.name}: replay order differs from capture order: expected graph "
                f"#{self.cursor} ({expected}) of {len(self.sequence)} captured in this pool, got "
                f"{'a graph of another pool' if position is None else f'graph #{position} ({graph})'}. "
                f"Graphs sharing a pool reuse each other's freed memory in capture order; "
                f"replay them in that order (or give them private pools). After a forward whose "
                f"backward never came, call release_pending() on the graphed model (or rewind() "
                f"this pool's order)")
        self.cursor = (self.cursor + 1) % len(self.sequence)

    def rewind(self) -> None:
        """Start the next replay at the first captured graph (e.g. after an aborted iteration)."""
        self.cursor = 0

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[None]:
        """Replays in any order, for timing one graph alone once training is done: it may
        overwrite memory that graphs captured after it keep, so the pool's data is not to be
        trusted afterwards. The replay position is put back when the block ends."""
        strict, cursor = self.strict, self.cursor
        self.strict = False
        try:
            yield
        finally:
            self.strict, self.cursor = strict, cursor


class Pool:
    """Graphs that share memory, and their replay order. Backends subclass it per kind.

    ``independent``: the graphs run one at a time and each leaves nothing of the pool allocated
    when its capture ends (checked there, where the backend can tell), so no graph's memory is
    live while another runs, and they may replay in any order (one block recompute after another,
    in whatever order the schedule's backwards come).
    """

    kind = "pool"  # the backend's name, for messages

    def __init__(self, number: int, private: bool = False, independent: bool = False):
        self.id = number  # the backend numbers its pools, the pool its graphs
        self.graph_numbers = itertools.count()
        self.private = private
        self.independent = independent
        self.order = PoolOrder(f"{self.kind} pool {self.id}", strict=not independent)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.id}{' (private)' if self.private else ''}: "
                f"{len(self.order.sequence)} graphs>")


class Graph(ABC):
    """One captured sequence of device work: new -> capturing -> captured (or failed).

    The life cycle and the pool's replay order live here; a backend provides ``_record`` (a
    context manager around the captured body that sets ``self.stats`` when it completes) and
    ``_replay``.
    """

    def __init__(self, pool: Pool):
        self.pool = pool
        self.name = f"{pool.kind} graph {next(pool.graph_numbers)} (pool {pool.id})"
        self.stats = CaptureSafetyReport()
        self.made_storages: set[int] = set()  # storage ids allocated by the capture (set by _record)
        self.replays = 0
        self._state = "new"

    def __repr__(self) -> str:
        return f"<{self.name}: {self._state}>"

    def external_reads(self) -> dict[int, int] | None:
        """``{storage id: bytes}`` of what the graph reads that its capture did not allocate
        (static inputs, parameters, what an earlier graph left), or ``None`` where the backend
        keeps no record of its kernels' arguments (a CUDA graph)."""
        return None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Run the body once, recording its ops. A graph is captured at most once."""
        if self._state != "new":
            raise GraphCaptureError(f"{self.name}: capture() called on a graph that is {self._state}; "
                                    f"make a new graph with backend.new_graph()")
        self._state = "capturing"
        # Python's garbage collector must not run inside a capture: it could destroy an older
        # graph or free a tensor whose memory the capture is using (torch >= 2.9 no longer
        # pauses it around torch.cuda.graph; TE does)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with self._record():
                yield
        except BaseException:
            self._state = "failed"
            raise
        finally:
            if gc_was_enabled:
                gc.enable()
        if self.pool.independent and self.stats.escaped_bytes:
            self._state = "failed"
            raise GraphCaptureError(
                f"{self.name}: {self.stats.escaped_bytes} bytes in {self.stats.escaped_storages} "
                f"storages allocated by this capture are still alive after it, in a pool of "
                f"independent graphs; another graph of the pool may reuse that memory while they "
                f"are live. Return nothing from the captured body and keep no reference to its "
                f"temporaries, or give the graph its own pool", self.stats)
        self._state = "captured"
        self.pool.order.captured(self)

    def release_outputs(self, tensors: list) -> list:
        """Give the pool back the memory of ``tensors`` (made by this capture), keeping access.

        Returns tensors aliasing the same memory (``None`` stays ``None``) that no longer keep it
        allocated: later captures in the pool may be handed it, so a replay of any *other* graph of
        the pool may overwrite it. The caller must read them after this graph's replay and before
        the pool's next replay. The base class keeps the memory (always safe).
        """
        if self._state != "captured":
            raise GraphCaptureError(f"{self.name}: release_outputs() before the capture ended")
        # only what this capture allocated is the pool's to take back (an output may be an input)
        return [t if t is None or storage_id(t) not in self.made_storages else self._release(t)
                for t in tensors]

    def _release(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def free_early(self, t: torch.Tensor) -> torch.Tensor:
        """Give the pool back the memory of ``t`` (made by this capture) now, though ``t`` itself
        is still referenced (a later capture needs its autograd history, not its bytes).

        Returns a tensor over the same memory, ``t``'s shape and layout, that keeps nothing
        allocated: the caller's from this graph's replay to the pool's next replay, as a
        :meth:`release_outputs` result; ``t`` is not to be read again. The base class keeps the
        memory (always safe).
        """
        if self._state != "captured":
            raise GraphCaptureError(f"{self.name}: free_early() before the capture ended")
        if storage_id(t) not in self.made_storages:
            raise GraphCaptureError(f"{self.name}: free_early() of a tensor this capture did not "
                                    f"allocate")
        return self._free_early(t)

    def _free_early(self, t: torch.Tensor) -> torch.Tensor:
        return self._release(t)

    def replay(self) -> None:
        """Re-run the recorded ops on the recorded tensors; runs no Python of the user's."""
        if self._state != "captured":
            raise GraphReplayError(f"{self.name}: replay() of a graph that is {self._state}")
        self.pool.order.check_replay(self)
        self._replay()
        self.replays += 1

    @abstractmethod
    def _record(self) -> ContextManager[None]:
        """Record the body; on success set ``self.stats`` and ``self.made_storages``."""

    @abstractmethod
    def _replay(self) -> None:
        """Run the recorded work once."""


class GraphBackend(ABC):
    """Makes pools and graphs; see the module docstring for the contract."""

    name: str
    device: str
    pool_type: type[Pool]
    graph_type: type[Graph]
    # eager iterations before a capture, for lazy library setup (cuBLAS handles, workspaces)
    warmup_iters: int = 3

    def __init__(self) -> None:
        self.pool_numbers = itertools.count()

    def new_pool(self, independent: bool = False) -> Pool:
        """A pool that graphs may share; ``independent``: see :class:`Pool`."""
        return self.pool_type(next(self.pool_numbers), independent=independent)

    def new_graph(self, pool: Pool | None = None) -> Graph:
        """A fresh graph; ``pool=None`` gives it a private pool."""
        if pool is None:
            pool = self.pool_type(next(self.pool_numbers), private=True)
        elif not isinstance(pool, self.pool_type):
            raise TypeError(f"{self.name} backend: new_graph(pool=...) takes a pool from "
                            f"new_pool() or None, got {type(pool).__name__}")
        return self.graph_type(pool)

    def warmup(self) -> ContextManager[None]:
        """Context for eager warmup iterations (a side stream on CUDA)."""
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for device work (no-op on the tape)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} device={self.device!r}>"
