"""megatron-core's TE graph helper, with mhc_cg's recompute graphs captured along its order.

What is hooked: megatron-core's ``megatron.core.transformer.cuda_graphs.TECudaGraphHelper``
(``cuda_graph_impl: transformer_engine``), in megatron-core 0.16.1 and in Megatron-LM main and dev
alike.
Its ``create_cudagraphs()`` builds the rank's schedule order in ``_get_cuda_graph_input_data()``
(``kwargs["_order"]`` for TE's ``make_graphed_callables``), captures every layer graph along it,
then calls ``_finish_capturing()``. ``RecomputeCaptureMixin`` overrides exactly those two:

* ``_get_cuda_graph_input_data``: remembers the order megatron computed, checks it is the order
  the runtime's slot sets were planned for, and rewinds each layer's capture count (each graph
  of a layer is one microbatch's, and writes that microbatch's slot set);
* ``_finish_capturing``: before megatron ends its capture phase (zeroes gradients, frees the
  warm-up state), captures one recompute graph per (chunk, recompute block, persistent slot set)
  in the order the schedule first needs them: walking the order, at each backward ``-c`` of
  microbatch k, chunk c's blocks last to first, on the slot set microbatch k's forward took
  (:func:`mhc_cg.core.pipeline_order.assign_persistent_slot_sets`, first-in first-out, as at run time).

The recompute graphs of a rank share one pool of independent graphs (docs/design.md, invariant 4):
each leaves nothing allocated, so capturing them after the layer graphs does not disturb the
layer graphs' pool order, and they replay wherever a block's backward needs them.

``make_te_graph_helper`` puts every model chunk's decoder of the rank on the static runtime
(:func:`megatron_integration.capture.install.install_rank`: one arena and one pool of slot sets
for the rank, sized by its order; the layers' TE graphs are their attention sublayers, and the
MLP's with ``mlp`` in scope, with mHC state in arena slots) and returns the helper; call its
``create_cudagraphs()`` where megatron's training loop does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mhc_cg.core.pipeline_order import assign_persistent_slot_sets, decode_order, pipeline_order
from mhc_cg.graphs import CudaBackend, GraphBackend
from mhc_cg.runtime.recompute_captures import capture_recompute_graph, warm_up_recompute
from mhc_cg.runtime.static import StaticRecompute


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


def capture_recompute_graphs(order: Sequence[int], runtimes: Sequence[StaticRecompute],
                             backend=None) -> dict[RecomputeGraphKey, object]:
    """Capture every recompute graph of a rank along ``order``; ``runtimes[c - 1]`` is chunk c's.

    ``backend``: a graph backend (default: CUDA graphs, for runtimes on a GPU; off one the caller
    gives its backend, the lab's tape on a CPU). The graphs share one pool of independent graphs
    and are also kept by their runtimes, whose block hooks replay them.
    """
    sizes = {rt.layout.block_size for rt in runtimes}
    if len(sizes) != 1:
        raise ValueError(f"every model chunk needs the same recompute block size, got {sorted(sizes)}")
    if backend is None:
        if runtimes[0].arena.buffer.device.type != "cuda":
            raise ValueError("capture_recompute_graphs: the runtimes are off a GPU; give the "
                             "backend to capture on (make_te_graph_helper(..., backend=...))")
        backend = CudaBackend()
    for runtime in runtimes:
        warm_up_recompute(runtime, backend)
    pool = backend.new_pool(independent=True)
    graphs = {}
    for key in recompute_capture_order(order, [len(rt.layout.layers) for rt in runtimes],
                                       sizes.pop()):
        runtime = runtimes[key.chunk - 1]
        graphs[key] = runtime.recompute_graphs[(key.block, key.slot_set)] = \
            capture_recompute_graph(runtime, backend, pool, key.block,
                                    runtime.sets.all_sets()[key.slot_set])
    return graphs


class RecomputeCaptureMixin:
    """Put before ``TECudaGraphHelper`` in the bases; see the module docstring.

    ``mhc_recompute_graph``: capture the recompute graphs (``mhc_recompute`` in the graph scope);
    without it the runtimes recompute eagerly. The graphs end up in ``mhc_recompute_graphs``
    keyed by ``RecomputeGraphKey``, in capture order.
    """

    mhc_recompute_graph: bool = True
    mhc_backend: GraphBackend | None = None  # what the recompute graphs capture on (None: CUDA)

    def _get_cuda_graph_input_data(self):
        sample_args, kwargs = super()._get_cuda_graph_input_data()
        self.mhc_order = list(kwargs["_order"])
        decoders = self.mhc_decoders()
        planned = decoders[0].mhc_static.order if decoders else None
        if planned is not None and planned != self.mhc_order:
            raise RuntimeError(f"megatron's TE graph helper captures along {self.mhc_order}, but "
                               f"the static runtime was installed for {planned}; install it with "
                               f"the helper's order (make_te_graph_helper does)")
        for decoder in decoders:  # a capture after delete_cuda_graphs starts at microbatch 0
            for layer in decoder.layers:
                layer.mhc_site.captures = 0
        return sample_args, kwargs

    def _finish_capturing(self, start_time):
        self.mhc_recompute_graphs = {}
        if self.mhc_recompute_graph:
            self.mhc_recompute_graphs = capture_recompute_graphs(self.mhc_order, self.mhc_runtimes(),
                                                                 self.mhc_backend)
        return super()._finish_capturing(start_time)

    def mhc_decoders(self) -> list:
        """Each model chunk's decoder on the static runtime, chunk 1 first."""
        return [chunk_decoder(chunk) for chunk in self.model]

    def mhc_runtimes(self) -> list[StaticRecompute]:
        """Each model chunk's static runtime, chunk 1 first."""
        return [decoder.mhc_static.runtime for decoder in self.mhc_decoders()]


def model_chunks(model) -> list:
    """megatron's model as the list of this rank's model chunks (it passes one or a list)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def chunk_decoder(model_chunk):
    """The decoder (``TransformerBlock``) of a model chunk, through megatron's wrappers."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model_chunk, "decoder", allow_none=False, return_model_obj=True
                                  ).decoder


def install_static_runtime(chunks: list, config, seq_length: int, micro_batch_size: int,
                           fused_mhc: bool | None = None) -> None:
    """Every chunk's decoder of this rank on one static runtime (:func:`install_rank`: one arena,
    one pool of persistent slot sets for the rank's order); a no-op where it is installed. What
    :func:`make_te_graph_helper` does before the helper, and all a full-iteration capture needs.
    ``fused_mhc``: Megatron-LM's layers on mhc_cg's fused kernels (``None``: the config's
    ``use_fused_mhc``)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from megatron_integration.capture.install import install_rank

    decoders = [chunk_decoder(chunk) for chunk in chunks]
    if not hasattr(decoders[0], "mhc_static"):
        install_rank(decoders, static_block_type(decoders[0]),
                     seq_length=rank_seq_length(config, seq_length),
                     micro_batch_size=micro_batch_size,
                     order=rank_order(config, len(chunks), get_num_microbatches()),
                     fused_mhc=fused_mhc)


_HELPERS: dict[type, type] = {}


def mhc_te_graph_helper(model, config, seq_length: int, micro_batch_size: int,
                        optimizers: Sequence = (), **helper_kwargs):
    """What a training script names where Megatron-LM's ``train()`` looks ``TECudaGraphHelper``
    up (``megatron.training.training.TECudaGraphHelper = mhc_te_graph_helper``,
    ``examples/megatron/``): called as megatron calls its helper, it returns
    :func:`make_te_graph_helper`'s, recompute graphs on unless the config says otherwise."""
    return make_te_graph_helper(model, config, seq_length, micro_batch_size, optimizers,
                                **helper_kwargs)


def make_te_graph_helper(model, config, seq_length: int, micro_batch_size: int,
                         optimizers: Sequence = (), *, recompute_graphs: bool | None = None,
                         backend: GraphBackend | None = None, fused_mhc: bool | None = None,
                         **helper_kwargs):
    """megatron-core's ``TECudaGraphHelper`` over mHC layers on the static runtime.

    ``model``: megatron's list of model chunks of this rank (DDP-wrapped, as the helper expects).
    Unless they are on the static runtime already, every chunk's decoder is put there, sharing
    one arena and one pool of persistent sets sized by the rank's order
    (:func:`rank_order`, checked against the helper's own when it captures).
    ``recompute_graphs``: capture the recompute graphs (default: ``config.mhc_recompute_graph``,
    set by ``mhc_recompute`` in the scope of an ``MHCTransformerConfig``; on with Megatron-LM's
    own config, which has no such field). ``backend``: what the recompute graphs capture on
    (default: CUDA graphs; the CPU harness gives the tape). ``fused_mhc``: the layers' mHC on
    mhc_cg's fused kernels (default: the config's ``use_fused_mhc``, Megatron-LM dev's
    ``--use-fused-mhc``; main has no such field: pass True). ``helper_kwargs``: the rest of what
    megatron's helper
    takes (``pg_collection``, dev's ``thd_sequence_length_upper_bound``). Needs
    TransformerEngine (on the CPU, the stand-in in ``mhc_cg/lab/megatron_harness/te_on_tape``);
    megatron-core's helper asserts its graph support.
    """
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    chunks = model_chunks(model)
    install_static_runtime(chunks, config, seq_length, micro_batch_size, fused_mhc)
    if TECudaGraphHelper not in _HELPERS:  # looked up per call: loading TE re-imports the module
        _HELPERS[TECudaGraphHelper] = type("MHCTECudaGraphHelper",
                                           (RecomputeCaptureMixin, TECudaGraphHelper), {})
    helper = _HELPERS[TECudaGraphHelper](chunks, config, seq_length, micro_batch_size,
                                         list(optimizers), **helper_kwargs)
    helper.mhc_recompute_graph = (getattr(config, "mhc_recompute_graph", True)
                                  if recompute_graphs is None else recompute_graphs)
    helper.mhc_backend = backend
    return helper


def rank_order(config, num_chunks: int, num_microbatches: int) -> list[int]:
    """The order megatron's TE graph helper captures this rank's layer graphs along: one
    microbatch without a pipeline (its one graph per layer serves every microbatch), else the
    rank's pipeline schedule (:func:`mhc_cg.core.pipeline_order.pipeline_order`, megatron's own)."""
    from megatron.core import parallel_state

    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return [1, -1]
    return pipeline_order(pp_size, parallel_state.get_pipeline_model_parallel_rank(),
                          num_microbatches, num_chunks, config.microbatch_group_size_per_vp_stage)


def rank_seq_length(config, seq_length: int) -> int:
    """The sequence length a layer of this rank sees: split over the tensor-parallel ranks under
    sequence parallelism."""
    if getattr(config, "sequence_parallel", False):
        return seq_length // config.tensor_model_parallel_size
    return seq_length


def static_block_type(decoder) -> type:
    """The static block for a decoder's layers: ``StaticMHCBlock`` for mhc_cg's layer,
    ``StaticMainBlock`` / ``StaticDevBlock`` for Megatron-LM main's / dev's
    ``HyperConnectionTransformerLayer``, ``StaticHybridBlock`` for dev's hybrid stack."""
    from megatron_integration.capture.static_block import (StaticDevBlock, StaticHybridBlock,
                                                           StaticMainBlock, StaticMHCBlock)
    from megatron_integration.layers.dev_layer import is_dev_config
    from megatron_integration.layers.hybrid_layer import is_hybrid_layer

    if is_hybrid_layer(decoder.layers[0]):
        return StaticHybridBlock
    if not hasattr(decoder.layers[0], "self_attention_hyper_connection"):
        return StaticMHCBlock
    return StaticDevBlock if is_dev_config(decoder.config) else StaticMainBlock
