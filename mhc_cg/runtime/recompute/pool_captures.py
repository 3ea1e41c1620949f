"""The block recompute graphs captured into the sublayer graphs' pool, each where it replays.

Note [recompute graphs in the sublayer pool]: with every sublayer a graph, replayed in one fixed
order per step, block b's recompute replays after the backward of block b + 1's first sublayer
(whose input gradient fires block b's hook) and before the backward of block b's last sublayer.
Captured at that point of the sublayer graphs' capture sequence, into their pool, its
temporaries take memory the forward graphs' temporaries had, instead of a pool of its own; the
pool's replay order is then the capture order, as every pool's must be.

It gets there through the capture API's own hooks, TransformerEngine's ``capture_time_hooks``
(mhc_cg's ``make_graphed_callables`` takes the same): a ``backward_pre_hook`` on block b's last
sublayer, which runs just before that sublayer's backward is captured, outside the capture.
Those hooks run at every warm-up iteration too; the ``post_warmup_hook`` arms the captures, so
each graph is captured once, at capture.
"""

from __future__ import annotations

import functools

from torch import nn

from mhc_cg.runtime.graphs.capture import GraphBackend, Pool
from mhc_cg.runtime.recompute.persistent import PersistentSlotSet
from mhc_cg.runtime.recompute.static import StaticRecompute


class RecomputeCaptures:
    """Block recompute graphs of ``runtime`` on ``pset``, captured on ``backend`` into ``pool``
    by the capture-time hooks of :meth:`hooks` (Note [recompute graphs in the sublayer pool])."""

    def __init__(self, runtime: StaticRecompute, backend: GraphBackend, pool: Pool,
                 pset: PersistentSlotSet):
        self.runtime, self.backend, self.pool, self.pset = runtime, backend, pool, pset
        self.armed = False

    def arm(self) -> None:
        """The ``post_warmup_hook``: from now on a hook captures."""
        self.armed = True

    def capture(self, block: int, module: nn.Module) -> None:
        if self.armed:
            self.runtime.capture_recompute_graph(self.backend, self.pool, block, self.pset)

    def hooks(self, before: dict[int, int], callables: int) -> list[dict | None]:
        """``capture_time_hooks``: at callable i of ``before``, block ``before[i]``'s capture."""
        return [None if i not in before else
                {"backward_pre_hooks": {"mhc_recompute": functools.partial(self.capture, before[i])}}
                for i in range(callables)]
