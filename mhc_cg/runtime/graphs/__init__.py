"""Graph capture for mhc_cg: one small capture interface over three backends, and a
TransformerEngine-compatible ``make_graphed_callables`` on top of it.

* ``tape``: CPU emulation (records aten ops under a ``TorchDispatchMode``, replays them);
* ``cuda``: ``torch.cuda.CUDAGraph`` with shared pools;
* ``te``: TransformerEngine's ``make_graphed_callables`` (imported only when chosen).
"""

from mhc_cg.core.errors import GraphCaptureError, GraphReplayError
from mhc_cg.runtime.graphs.backends import get_backend, resolve_backend_name
from mhc_cg.runtime.graphs.capture import Graph, GraphBackend, PoolOrder, graph_capturing
from mhc_cg.runtime.graphs.guard import CaptureSafetyReport
from mhc_cg.runtime.graphs.graphed_callables import (GraphedCallables, OrderLayout, count_allocated_static_inputs,
                                make_graphed_callables)

__all__ = ["GraphedCallables", "OrderLayout", "count_allocated_static_inputs",
           "make_graphed_callables", "CaptureSafetyReport", "Graph", "GraphBackend", "GraphCaptureError",
           "GraphReplayError", "PoolOrder", "get_backend", "graph_capturing", "resolve_backend_name"]
