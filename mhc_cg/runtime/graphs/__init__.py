"""Graph capture for mhc_cg: one small capture interface over two primitives, a
TransformerEngine-compatible ``make_graphed_callables`` on top of it, and TE's own.

* ``tape``: CPU emulation (records aten ops under a ``TorchDispatchMode``, replays them);
* ``cuda``: ``torch.cuda.CUDAGraph`` with shared pools;
* ``te``: TransformerEngine's own ``make_graphed_callables`` (installed, or its wheel's
  ``graph.py``), over either primitive (``te``, ``te_wheel``, ``cuda_api``).

The modules, by concept: ``capture`` (pools, graphs, replay order), ``guard`` (what a capture
refuses), ``tape``/``cuda`` (the primitives), ``cuda_api`` (``torch.cuda``'s graph API served by
a primitive), ``te_wheel`` (TE's Python from its wheel), ``te`` (the capture API a run uses:
TE's function or ours), ``static_inputs`` (static buffers), and
``make_graphed_callables``'s parts: ``order_layout`` (TE's ``_order`` and the shared input
buffers), ``replay_state`` (one graphed callable's graphs, buffers and autograd function),
``grad_lending`` (grads handed on uncloned), ``autograd_graph`` (what autograd saved) and
``graphed_callables`` (the call itself: warm up, capture along the order, wrap).
"""

from mhc_cg.core.errors import GraphCaptureError, GraphReplayError
from mhc_cg.runtime.graphs.backends import get_backend, resolve_backend_name
from mhc_cg.runtime.graphs.capture import Graph, GraphBackend, PoolOrder, graph_capturing
from mhc_cg.runtime.graphs.guard import CaptureSafetyReport
from mhc_cg.runtime.graphs.graphed_callables import (GraphedCallables, GraphOptions,
                                                     count_allocated_static_inputs,
                                                     make_graphed_callables)
from mhc_cg.runtime.graphs.order_layout import OrderLayout

__all__ = ["GraphedCallables", "GraphOptions", "OrderLayout", "count_allocated_static_inputs",
           "make_graphed_callables", "CaptureSafetyReport", "Graph", "GraphBackend", "GraphCaptureError",
           "GraphReplayError", "PoolOrder", "get_backend", "graph_capturing", "resolve_backend_name"]
