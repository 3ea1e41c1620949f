"""The block recompute graphs: warmed up, then captured, each from one persistent set.

A block's recompute is a pure function of its persistent set, writing arena slots only, so a
graph of it serves every step (Note [recompute graphs], docs/design.md, item 4). These functions
capture them; the runtime replays what it is given (``Recomputer.graphs``, keyed
``(block, set)``), and runs a block eagerly where it has none.

* :func:`capture_recompute_graphs`: every (block, set) into one pool of independent graphs of
  their own (they run one at a time and leave nothing allocated, so they may replay in any
  order), captured in the order a backward replays them (last block first, sets in turn).
* :class:`RecomputeCaptures`: into the sublayer graphs' pool, each where it replays.

Note [recompute graphs in the sublayer pool]: with every sublayer a graph, replayed in one fixed
order per step, block b's recompute replays after the backward of block b + 1's first sublayer
(whose input gradient fires block b's hook) and before the backward of block b's last sublayer.
Captured at that point of the sublayer graphs' capture sequence, into their pool, its
temporaries take memory the forward graphs' temporaries had, instead of a pool of its own; the
pool's replay order is then the capture order, as every pool's must be. It gets there through
the capture API's own hooks, TransformerEngine's ``capture_time_hooks`` (mhc_cg's
``make_graphed_callables`` takes the same): a ``backward_pre_hook`` on block b's last sublayer,
which runs just before that sublayer's backward is captured, outside the capture. Those hooks
run at every warm-up iteration too; the ``post_warmup_hook`` arms the captures, so each graph is
captured once, at capture.
"""

from __future__ import annotations

import functools

from torch import nn

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.core.regions import region
from mhc_cg.graphs.capture import Graph, GraphBackend, Pool
from mhc_cg.runtime.persistent import PersistentSlotSet
from mhc_cg.runtime.static import StaticRecompute


def warm_up_recompute(runtime: StaticRecompute, backend: GraphBackend) -> None:
    """Run every block's recompute once eagerly, in the backend's warmup context (a side stream
    on CUDA), so that lazy library setup (cuBLAS handles, workspaces) never happens inside a
    capture. It writes slots that the next forward overwrites anyway."""
    with backend.warmup():
        for block in range(runtime.layout.num_blocks):
            runtime.recompute(block, runtime.sets.template)
    backend.synchronize()


def capture_recompute_graph(runtime: StaticRecompute, backend: GraphBackend, pool: Pool,
                            block: int, pset: PersistentSlotSet) -> Graph:
    """Block ``block``'s recompute from ``pset``, captured into ``pool``.

    It must leave nothing of the pool allocated (it writes only arena slots, which are not the
    pool's): its temporaries are dead when the block's backward starts, whatever shares the pool.
    """
    graph = backend.new_graph(pool=pool)
    with graph.capture(), region("recompute"):
        runtime.recompute(block, pset)
    if graph.stats.escaped_bytes:
        raise StaticRecomputeError(
            f"recompute graph of block {block}: {graph.stats.escaped_bytes} bytes allocated by "
            f"the capture are still alive after it; a later graph of the pool could overwrite them")
    return graph


def capture_recompute_graphs(runtime: StaticRecompute,
                             backend: GraphBackend) -> dict[tuple[int, int], Graph]:
    """One recompute graph per (block, persistent set) of ``runtime``, in one pool of
    independent graphs (the module docstring); returns them keyed ``(block, set)``, for
    ``runtime.recompute_graphs``."""
    warm_up_recompute(runtime, backend)
    pool = backend.new_pool(independent=True)
    graphs = {}
    for pset in runtime.sets.all_sets():
        for block in reversed(range(runtime.layout.num_blocks)):
            graphs[(block, pset.index)] = capture_recompute_graph(runtime, backend, pool, block,
                                                                  pset)
    return graphs


class RecomputeCaptures:
    """Block recompute graphs of ``runtime`` on ``pset``, captured on ``backend`` into ``pool``
    by the capture-time hooks of :meth:`hooks` (Note [recompute graphs in the sublayer pool]);
    ``graphs`` holds them keyed ``(block, set)``."""

    def __init__(self, runtime: StaticRecompute, backend: GraphBackend, pool: Pool,
                 pset: PersistentSlotSet):
        self.runtime, self.backend, self.pool, self.pset = runtime, backend, pool, pset
        self.armed = False
        self.graphs: dict[tuple[int, int], Graph] = {}

    def arm(self) -> None:
        """The ``post_warmup_hook``: from now on a hook captures."""
        self.armed = True

    def capture(self, block: int, module: nn.Module) -> None:
        if self.armed:
            self.graphs[(block, self.pset.index)] = capture_recompute_graph(
                self.runtime, self.backend, self.pool, block, self.pset)

    def hooks(self, before: dict[int, int], callables: int) -> list[dict | None]:
        """``capture_time_hooks``: at callable i of ``before``, block ``before[i]``'s capture."""
        return [None if i not in before else
                {"backward_pre_hooks": {"mhc_recompute": functools.partial(self.capture, before[i])}}
                for i in range(callables)]
