"""Megatron's full-iteration graph (``FullCudaGraphWrapper``, ``--cuda-graph-impl full_iteration``)
over decoders on mhc_cg's static runtime.

Megatron-LM's ``train()`` wraps its ``forward_backward_func`` in the class it names
``FullCudaGraphWrapper`` in ``megatron.training.training``; a training script names
:class:`MHCFullCudaGraphWrapper` there (``examples/megatron/``). On the first training call it
puts every model chunk's decoder on the static runtime
(:func:`~megatron_integration.capture.te_graph_helper.install_static_runtime`: the recompute
runs inside the iteration's graph), then it is Megatron's own wrapper: its warm-up iterations,
its one capture of the whole iteration, its replays. A class and not a function: ``train()`` also
reads the wrapper's class attributes (``FullCudaGraphWrapper.cuda_graph``).
"""

from __future__ import annotations

from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.utils import get_model_config

from megatron_integration.capture.te_graph_helper import install_static_runtime, model_chunks


class MHCFullCudaGraphWrapper(FullCudaGraphWrapper):
    """Megatron's ``FullCudaGraphWrapper``, the rank's decoders on the static runtime first."""

    def __call__(self, *args, **kwargs):
        if not kwargs.get("forward_only", False):
            chunks = model_chunks(kwargs["model"])
            install_static_runtime(chunks, get_model_config(chunks[0]), kwargs["seq_length"],
                                   kwargs["micro_batch_size"])
        return super().__call__(*args, **kwargs)
