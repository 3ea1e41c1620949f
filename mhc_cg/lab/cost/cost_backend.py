"""The recording backend: graphs captured for their cost, on any device (``meta`` included).

A capture runs the body once under :class:`~mhc_cg.lab.cost.op_counters.CaptureRecorder` (the same guard
every backend captures under, plus a kernel counter and the pool's block table), so the same
illegal ops are refused. A replay does no work: it adds the graph's kernels and bytes to the
training step being recorded. Pools share blocks as CUDA pools do
(:mod:`mhc_cg.lab.cost.allocator`); pool order is kept like on every backend.

On ``meta`` nothing is allocated, so the benchmark shape is costed on a laptop; on ``cpu`` the
ops really run (values are never read back). Either way values are never replayed: this backend
costs graphs, it does not train with them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from mhc_cg.lab.cost.allocator import CapturePeak, PoolState
from mhc_cg.lab.cost.op_counters import CaptureRecorder, OpCounter, StepRecorder, StreamTracker
from mhc_cg.lab.cost.step_model import StepModel
from mhc_cg.graphs.capture import Graph, GraphBackend, Pool


class CostPool(Pool):
    """A pool and its emulated allocator state; ``log`` receives its graphs in capture order."""

    kind = "cost"

    def __init__(self, number: int, private: bool = False, independent: bool = False):
        super().__init__(number, private, independent)
        self.state = PoolState()
        self.log: list["CostGraph"] = []
        # set by the backend that registers the pool: what marks mHC traffic, what times a kernel,
        # and the steps being recorded that a replay reports to
        self.streams: StreamTracker | None = None
        self.model: StepModel | None = None
        self.steps: list[StepRecorder] = []


class CostGraph(Graph):
    """A capture recorded for its cost; ``cost`` (kernels, bytes) and ``peak`` after capture."""

    def __init__(self, pool: CostPool):
        super().__init__(pool)
        self.cost = OpCounter()
        self.peak = CapturePeak()

    @contextlib.contextmanager
    def _record(self) -> Iterator[None]:
        recorder = CaptureRecorder(self.name, self.pool.state, self.pool.streams, self.pool.model)
        with recorder:
            yield
        self.stats = recorder.finish()
        self.made_storages = recorder.made_storages()
        self.cost = recorder.counter
        self.peak = recorder.settle()
        self.pool.log.append(self)

    def _replay(self) -> None:
        for step in self.pool.steps:
            step.replayed(self.cost)

    def _release(self, t: torch.Tensor) -> torch.Tensor:
        # values are never replayed here: a fresh storage lets the pool see the block freed
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)

    def _free_early(self, t: torch.Tensor) -> torch.Tensor:
        t.untyped_storage().resize_(0)  # the pool's block table sees it freed
        return self._release(t)


class CostBackend(GraphBackend):
    """Makes :class:`CostGraph` graphs on ``device``, timed by ``model``; ``captured`` lists them
    in capture order."""

    name = "cost"
    pool_type = CostPool
    graph_type = CostGraph
    warmup_iters = 0  # nothing to set up lazily; warmups would only cost time on meta

    def __init__(self, device: str = "meta", streams: StreamTracker | None = None,
                 model: StepModel | None = None):
        super().__init__()
        self.device = str(device)
        self.streams = streams  # what marks an op's bytes as mHC traffic
        self.model = model
        self.captured: list[CostGraph] = []
        self.pools: list[CostPool] = []
        self.steps: list[StepRecorder] = []  # the steps being recorded (:meth:`recording_step`)

    @contextlib.contextmanager
    def recording_step(self, device: torch.device | str | None = None) -> Iterator[StepRecorder]:
        """A :class:`StepRecorder` of what runs inside: eager ops by dispatch, and each replay
        of this backend's graphs."""
        recorder = StepRecorder(self.streams, device, self.model)
        self.steps.append(recorder)
        try:
            with recorder:
                yield recorder
        finally:
            self.steps.remove(recorder)

    def _register(self, pool: CostPool) -> CostPool:
        pool.streams, pool.model, pool.steps = self.streams, self.model, self.steps
        if pool not in self.pools:
            pool.log = self.captured
            self.pools.append(pool)
        return pool

    def new_pool(self, independent: bool = False) -> CostPool:
        return self._register(super().new_pool(independent))

    def new_graph(self, pool: CostPool | None = None) -> CostGraph:
        graph = super().new_graph(pool)
        self._register(graph.pool)
        return graph
