"""CUDA graphs with plain PyTorch: ``torch.cuda.CUDAGraph`` on shared memory pools.

The capture runs under :class:`~mhc_cg.graphs.backend.CaptureGuardMode` too, so an illegal op is
rejected with the op's name and the user's line before CUDA reports a bare "operation not
permitted when stream is capturing", and storage resizes are caught like on the tape. The guard
only checks; the driver records the kernels.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import torch

from .backend import CaptureGuardMode, CaptureSafetyReport, Graph, GraphBackend, GraphCaptureError, \
    GraphReplayError, PoolOrder


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device (torch.cuda.is_available() is False); "
                           f"use backend='tape' to emulate graphs on the CPU")


class CudaPool:
    """A ``torch.cuda.graph_pool_handle()`` and the replay order of the graphs that share it."""

    _ids = itertools.count()

    def __init__(self, handle=None, private: bool = False):
        _require_cuda("a CUDA graph pool")
        self.id = next(self._ids)
        self.private = private
        # A private pool: let torch.cuda.graph make one for the graph (pool=None).
        self.handle = handle if handle is not None or private else torch.cuda.graph_pool_handle()
        self.order = PoolOrder(f"cuda pool {self.id}")

    def __repr__(self) -> str:
        return f"<CudaPool {self.id}{' (private)' if self.private else ''}: " \
               f"{len(self.order.sequence)} graphs>"


class CudaGraph(Graph):
    """A ``torch.cuda.CUDAGraph`` captured on a side stream (``torch.cuda.graph`` does that)."""

    _ids = itertools.count()

    def __init__(self, pool: CudaPool):
        self.pool = pool
        self.name = f"cuda graph {next(self._ids)} (pool {pool.id})"
        self.graph = torch.cuda.CUDAGraph()
        self.stats = CaptureSafetyReport()
        self.replays = 0
        self._state = "new"

    def __repr__(self) -> str:
        return f"<{self.name}: {self._state}>"

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        if self._state != "new":
            raise GraphCaptureError(f"{self.name}: capture() called on a graph that is {self._state}; "
                                    f"make a new graph with backend.new_graph()")
        self._state = "capturing"
        guard = CaptureGuardMode(self.name)
        try:
            with torch.cuda.graph(self.graph, pool=self.pool.handle):
                with guard:
                    yield
            self.stats = guard.finish()
        except BaseException:
            self._state = "failed"
            raise
        self._state = "captured"
        self.pool.order.captured(self)

    def replay(self) -> None:
        if self._state != "captured":
            raise GraphReplayError(f"{self.name}: replay() of a graph that is {self._state}")
        self.pool.order.check_replay(self)
        self.graph.replay()
        self.replays += 1


class CudaBackend(GraphBackend):
    """``torch.cuda.CUDAGraph`` graphs; warmup runs on a side stream."""

    name = "cuda"
    device = "cuda"

    def __init__(self) -> None:
        _require_cuda("the 'cuda' graph backend")

    def new_pool(self) -> CudaPool:
        return CudaPool()

    def new_graph(self, pool: CudaPool | None = None) -> CudaGraph:
        if pool is None:
            pool = CudaPool(private=True)
        elif not isinstance(pool, CudaPool):
            raise TypeError(f"{self.name} backend: new_graph(pool=...) takes a pool from "
                            f"new_pool() or None, got {type(pool).__name__}")
        return CudaGraph(pool)

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
