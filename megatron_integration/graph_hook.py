"""Capturing the mHC recompute graphs alongside megatron-core's TE layer graphs.

What is hooked: megatron-core's ``megatron.core.transformer.cuda_graphs.TECudaGraphHelper``
(``cuda_graph_impl="transformer_engine"``). Its ``create_cudagraphs()`` builds the rank's schedule
order in ``_get_cuda_graph_input_data()`` (returned as ``kwargs["_order"]`` for TE's
``make_graphed_callables``), captures every layer graph along it, then calls
``_finish_capturing()``. ``RecomputeCaptureMixin`` overrides exactly those two methods:

* ``_get_cuda_graph_input_data``: remembers the order megatron-core computed;
* ``_finish_capturing``: before megatron-core ends its capture phase (zeroes gradients, frees the
  warm-up state), captures one recompute graph per (chunk, recompute block, persistent slot set)
  in the order the schedule first needs them: walking the order, at each backward ``-c`` of
  microbatch k, chunk c's blocks last to first, on the slot set microbatch k's forward took
  (``mhc_cg.tools.planner.assign_persistent_slot_sets``, first-in first-out, as at run time).

Each recompute graph has its own private pool (docs/design.md, invariant 4), so capturing it after the layer
graphs does not break the shared pool's capture-equals-replay order: only the recompute graphs'
order among themselves, and the slot sets they read, must follow the schedule, and they do.

``make_te_graph_helper`` needs TransformerEngine and a GPU (megatron-core's helper asserts TE's
graph support in ``__init__``); ``recompute_capture_order`` and the mixin run anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mhc_cg.core.schedule import assign_persistent_slot_sets
from mhc_cg.core.schedule import decode_order


@dataclass(frozen=True)
class RecomputeGraphKey:
    """One recompute graph: model chunk (1-based, as in the order), block (0-based), slot set."""

    chunk: int
    block: int
    slot_set: int


def recompute_capture_order(order: Sequence[int], layers_per_chunk: int | Sequence[int],
                            block_size: int) -> list[RecomputeGraphKey]:
    """Every recompute graph a rank needs, in the order its ``order`` first replays each.

    ``layers_per_chunk``: one count for every chunk, or one per chunk (1-based chunk c at c - 1).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    steps = decode_order(list(order))
    slot_sets = iter(assign_persistent_slot_sets(list(order)))
    set_of: dict[tuple[int, int], int] = {}
    seen: set[RecomputeGraphKey] = set()
    keys: list[RecomputeGraphKey] = []
    for step in steps:
        if step.forward:
            set_of[(step.chunk, step.microbatch)] = next(slot_sets)
            continue
        layers = (layers_per_chunk if isinstance(layers_per_chunk, int)
                  else layers_per_chunk[step.chunk - 1])
        for block in reversed(range(math.ceil(layers / block_size))):
            key = RecomputeGraphKey(step.chunk, block, set_of[(step.chunk, step.microbatch)])
            if key not in seen:
                seen.add(key)
                keys.append(key)
    return keys


CaptureRecompute = Callable[[RecomputeGraphKey], object]


class RecomputeCaptureMixin:
    """Put before ``TECudaGraphHelper`` in the bases; see the module docstring.

    Set ``mhc_capture_recompute`` (called once per key, returns the graph) and
    ``mhc_recompute_block_size`` before ``create_cudagraphs()``; the graphs end up in
    ``mhc_recompute_graphs`` keyed by ``RecomputeGraphKey``, in capture order.
    """

    mhc_capture_recompute: CaptureRecompute | None = None
    mhc_recompute_block_size: int = 1

    def _get_cuda_graph_input_data(self):
        sample_args, kwargs = super()._get_cuda_graph_input_data()
        self.mhc_order = list(kwargs["_order"])
        return sample_args, kwargs

    def _finish_capturing(self, start_time):
        self.mhc_recompute_graphs = {}
        if self.mhc_capture_recompute is not None:
            layers = [n for n in self.num_layers_per_chunk]
            for key in recompute_capture_order(self.mhc_order, layers, self.mhc_recompute_block_size):
                self.mhc_recompute_graphs[key] = self.mhc_capture_recompute(key)
        return super()._finish_capturing(start_time)


def make_te_graph_helper(model, config, seq_length: int, micro_batch_size: int,
                         capture_recompute: CaptureRecompute | None, optimizers=()):
    """megatron-core's ``TECudaGraphHelper`` with the recompute graphs captured in order.

    Needs TransformerEngine and CUDA (megatron-core asserts them). ``config`` is an
    ``MHCTransformerConfig``; its ``mhc_recompute_layer_num`` is the block size.
    """
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    class MHCTECudaGraphHelper(RecomputeCaptureMixin, TECudaGraphHelper):
        pass

    helper = MHCTECudaGraphHelper(model, config, seq_length, micro_batch_size, list(optimizers))
    helper.mhc_capture_recompute = capture_recompute if config.mhc_recompute_graph else None
    helper.mhc_recompute_block_size = config.mhc_recompute_layer_num or 1
    return helper
