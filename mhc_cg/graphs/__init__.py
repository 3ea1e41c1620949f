"""Graph capture for mhc_cg: one small capture interface over a primitive, a
TransformerEngine-compatible ``make_graphed_callables`` on top of it, and TE's own.

* ``cuda``: ``torch.cuda.CUDAGraph`` with shared pools (:mod:`~mhc_cg.graphs.cuda`);
* ``te``: TransformerEngine's own ``make_graphed_callables`` where TE is installed.

The CPU emulation of CUDA graphs (the tape), ``torch.cuda``'s graph API served by it and TE's
own Python from its wheel are the lab's (:mod:`mhc_cg.lab.emulation`): they implement the
interface here and are handed in, never imported.

The modules, by concept: ``capture`` (pools, graphs, replay order), ``guard`` (what a capture
refuses), ``cuda`` (the primitive), ``te`` (the capture API a run uses: TE's function or ours),
``static_inputs`` (static buffers), and ``make_graphed_callables``'s parts: ``order_layout``
(TE's ``_order`` and the shared input buffers), ``replay_state`` (one graphed callable's graphs,
buffers and autograd function), ``grad_lending`` (grads handed on uncloned), ``autograd_graph``
(what autograd saved) and ``graphed_callables`` (the call itself: warm up, capture along the
order, wrap).
"""

from mhc_cg.core.errors import GraphCaptureError, GraphReplayError
from mhc_cg.graphs.capture import Graph, GraphBackend, PoolOrder, graph_capturing
from mhc_cg.graphs.cuda import CudaBackend
from mhc_cg.graphs.guard import CaptureSafetyReport
from mhc_cg.graphs.graphed_callables import (GraphedCallables, GraphOptions,
                                                     count_allocated_static_inputs,
                                                     make_graphed_callables)
from mhc_cg.graphs.order_layout import OrderLayout

__all__ = ["GraphedCallables", "GraphOptions", "OrderLayout", "count_allocated_static_inputs",
           "make_graphed_callables", "CaptureSafetyReport", "CudaBackend", "Graph", "GraphBackend",
           "GraphCaptureError", "GraphReplayError", "PoolOrder", "graph_capturing"]
