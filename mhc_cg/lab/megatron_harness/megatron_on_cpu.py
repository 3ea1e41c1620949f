"""Running megatron-core's CUDA-first code on a CPU build of torch, in a process of its own.

``install_cpu_shims()`` replaces, for the rest of the process and only without CUDA, the few
calls megatron's modules make that a CPU build of torch refuses, each named here:

* ``TORCH_COMPILE_DISABLE=1``: several ``HyperConnectionModule`` methods of Megatron-LM main carry
  ``torch.compile``;
* ``torch.cuda.nvtx.range`` -> a null context (CPU torch raises);
* ``torch.cuda.current_device`` -> ``"cpu"``: buffers megatron allocates on "the current device"
  (``DotProductAttention``'s score buffer, DDP's grad buffers, the graph helper's static inputs)
  land on the CPU;
* ``torch.cuda.current_stream``, ``torch.cuda.Stream`` -> a stream with nothing to wait on, and
  ``torch.cuda.stream`` -> a null context: megatron's DDP asks for the current stream before
  each gradient reduction, to wait on events only a CUDA graph replay records; its all-to-all
  MoE dispatcher copies the routing counts to the host on a side stream of its own;
* ``fused_softmax.get_default_causal_mask`` (the causal mask when none is passed) -> the same
  mask on the CPU (megatron builds it on ``"cuda"``);
* megatron's CUDA RNG state getters/setters -> empty state / no-op: its
  ``CheckpointWithoutOutput`` saves and restores CPU *and* CUDA RNG states; on the CPU only the
  CPU generator exists (and it is still saved and restored);
* Megatron-LM dev's ``GraphableMegatronModule.set_te_cuda_graph_static_hidden_inputs`` (its TE
  graph helper hands each layer its graphs' static hidden inputs) refuses tensors that are not
  CUDA tensors: the same bookkeeping without that check; likewise its ``MHCRecomputeArenaSlot``
  (the attention-only split's fixed-address slots) for a CPU tensor;
* the all-to-all MoE dispatcher's ``maybe_move_tensor_to_cpu`` (its routing counts to the host,
  as numpy for the all-to-all's splits) copies only CUDA tensors: on the CPU it copies every
  tensor, so that, as on a GPU, the host copy does not alias a graph's static output that the
  next replay overwrites before the all-to-all's backward reads the splits;
* without TransformerEngine: ``CheckpointWithoutOutput`` always enters its TE path
  (``activation_recompute_forward``, ``FP8GlobalStateManager``, ``fp8_autocast``), whose names
  are then undefined; with FP8 off each is a no-op, so the shims are null contexts and "FP8 off".

The schedules' ``device="cuda"`` token counters are :func:`mhc_cg.lab.pipeline.schedules_on_cpu.cpu_shim`'s,
entered around each ``forward_backward_func`` call.
"""

from __future__ import annotations

import contextlib
import os
import types


def install_cpu_shims() -> None:
    """See the module docstring; call it before megatron builds anything."""
    import torch

    from mhc_cg.lab.emulation.cuda_api import HOST_STREAM, HostStream

    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        torch.cuda.nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.current_stream = lambda device=None: HOST_STREAM
        torch.cuda.Stream = HostStream
        torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
        from megatron.core.tensor_parallel import random as mrandom

        mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
        mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
        from megatron.core.fusions import fused_softmax

        fused_softmax.get_default_causal_mask = _causal_mask_on_cpu
        from megatron.core.transformer.module import GraphableMegatronModule

        if hasattr(GraphableMegatronModule, "set_te_cuda_graph_static_hidden_inputs"):
            GraphableMegatronModule.set_te_cuda_graph_static_hidden_inputs = \
                _static_hidden_inputs_on_cpu
        try:
            from megatron.core.transformer import mhc_recompute
        except ImportError:  # main and releases: no arena
            mhc_recompute = None
        if mhc_recompute is not None:
            mhc_recompute.MHCRecomputeArenaSlot.__init__ = _arena_slot_on_cpu
        try:
            from megatron.core.transformer.moe import token_dispatcher
        except ImportError:  # no MoE in this megatron-core
            token_dispatcher = None
        if token_dispatcher is not None and hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
            token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    from megatron.core.tensor_parallel import random as mrandom

    if not mrandom.HAVE_TE:
        # CheckpointWithoutOutput always takes its TE path (``self.fp8 = fp8 is not None``)
        mrandom.FP8GlobalStateManager = types.SimpleNamespace(
            is_fp8_enabled=lambda: False, get_fp8_recipe=lambda: None)
        mrandom.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
        mrandom.fp8_autocast = lambda enabled, fp8_recipe=None: _no_fp8(enabled)


def _causal_mask_on_cpu(sq: int):
    import torch

    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


def _static_hidden_inputs_on_cpu(self, inputs) -> None:
    inputs = tuple(inputs)
    if len(inputs) != len(self.cuda_graphs):
        raise ValueError(f"{len(inputs)} static hidden inputs for {len(self.cuda_graphs)} graphs")
    self._te_cuda_graph_static_hidden_inputs = inputs
    self._te_cuda_graph_static_hidden_input_ptrs = tuple(t.data_ptr() for t in inputs)


def _arena_slot_on_cpu(self, key, tensor) -> None:
    from megatron.core.transformer.mhc_recompute import MHCRecomputeSlotMetadata

    if not tensor.is_contiguous():
        raise ValueError("mHC recompute arena slots must be contiguous")
    self.key, self.consumer = key, tensor
    self.metadata = MHCRecomputeSlotMetadata(shape=tensor.shape, dtype=tensor.dtype,
                                             device=tensor.device, layout=tensor.layout,
                                             data_ptr=tensor.data_ptr())


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    import torch

    if not torch.is_tensor(tensor):
        return tensor
    copy = tensor.detach().clone()
    return copy.numpy() if as_numpy else copy


def _no_fp8(enabled: bool):
    if enabled:
        raise RuntimeError("FP8 needs TransformerEngine, which is not installed")
    return contextlib.nullcontext()
