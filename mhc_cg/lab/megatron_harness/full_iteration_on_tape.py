"""The CUDA graph API Megatron-LM dev's ``FullCudaGraphWrapper`` calls, served by mhc_cg's tape.

``megatron.core.full_cuda_graph.FullCudaGraphWrapper`` (``cuda_graph_impl: full_iteration``)
runs ``cuda_graph_warmup_steps`` iterations eagerly, then captures every microbatch's forward
and backward (pipeline sends and receives included) in one ``torch.cuda.CUDAGraph`` and replays
it from then on, its batches copied into static buffers first (``StaticBufferLoader``). On a CPU
build of torch none of that API exists; :func:`install_full_iteration_shims` puts, for the rest of
a harness process and only without CUDA, the tape behind every name the wrapper uses, as
:class:`mhc_cg.lab.emulation.cuda_api.CudaAPI` serves them on the tape (there, for one module's
``torch``; here, for megatron's code whole):

* ``torch.cuda.CUDAGraph`` -> :class:`TapeCUDAGraph` (the API's graph: ``capture_begin(pool)`` /
  ``capture_end()`` record on a tape graph, ``replay()`` replays it; host tensors kept off it);
* ``torch.cuda.graph`` -> the API's context manager over it;
* ``torch.cuda.graph_pool_handle`` -> a new tape pool;
* ``torch.cuda.synchronize``, ``torch.cuda.empty_cache`` -> nothing to do (the CPU runs every op
  in order; the tape returns no memory);
* ``torch.cuda.is_current_stream_capturing`` -> whether a tape capture is running;
* ``Tensor.cuda`` -> the tensor itself, registered as a static buffer
  (:func:`mhc_cg.graphs.static_inputs.static_buffer`): the CPU is the tape's device, and
  what a GPU run copies to the device (the wrapper's static batch buffers, a 0-dim dropout seed
  among them) is device memory a replay reads where it lies, not a host scalar the tape bakes.

``torch.cuda.Stream``/``stream``/``current_stream`` are :mod:`mhc_cg.lab.megatron_harness.megatron_on_cpu`'s.

A capture runs nothing, on the tape as with CUDA (the tape puts back what it wrote outside its
pool: Note [a capture runs nothing]), so dev's wrapper, which replays right after capturing,
counts the captured iteration once.

(``x[mask] = scalar``, which megatron's cross entropy and vocab-parallel embedding use, the
capture guard itself records as the masked fill ATen runs:
Note [x[mask] = scalar is a masked fill], :mod:`mhc_cg.graphs.guard`.)

One of megatron's own functions is shimmed, and only while a tape capture runs:
``megatron.core.utils._kernel_make_viewless_tensor`` (``make_viewless_tensor``, which
``TransformerBlock.forward`` calls on its hidden states) makes its tensor with ``out.data =
inp.data``, which no aten op carries: on a GPU it is metadata a capture never sees either, but the
tape, which replays on tensor objects, refuses a tensor moved to another storage outside any op it
records. The shim makes the same tensor (``inp``'s storage, offset, sizes and strides; no
``_base``; its own version counter) with ``set_``, an op the tape records.
"""

from __future__ import annotations

import torch

from mhc_cg.core.storage import storage_id
from mhc_cg.graphs import graph_capturing
from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.lab.emulation.cuda_api import CudaAPI
from mhc_cg.graphs.static_inputs import static_buffer
from mhc_cg.lab.cost.allocator import rounded

_API = CudaAPI(get_backend("tape"))


class TapeCUDAGraph(_API.CUDAGraph):
    """``torch.cuda.CUDAGraph`` on the tape, and what the harness reads of the graph dev's wrapper
    captured: the collectives it holds and the bytes its capture allocated."""

    def collectives(self) -> dict[str, int]:
        """``{c10d op: count}`` the graph holds (a pipeline's sends and receives, all-reduces)."""
        counts: dict[str, int] = {}
        for op in () if self.graph is None else self.graph.ops:
            if op.func.namespace == "c10d":
                counts[op.func.name()] = counts.get(op.func.name(), 0) + 1
        return counts

    def allocated_bytes(self) -> int:
        """Bytes the capture allocated (each storage at its largest, in 512-byte allocator blocks):
        the tape keeps every one for its replays, so this is what the graph's pool holds here; a
        CUDA pool, which hands a block freed during the capture to a later allocation, holds at
        most this many bytes live."""
        if self.graph is None:
            return 0
        made = self.graph.made_storages
        found: dict[int, int] = {}
        for op in self.graph.ops:
            for t in (*op.flat_args, *op.outputs):
                if isinstance(t, torch.Tensor) and storage_id(t) in made:
                    found.setdefault(storage_id(t), t.untyped_storage().nbytes())
        return sum(rounded(n) for n in found.values())


def _cuda_on_tape(self: torch.Tensor, device=None, non_blocking: bool = False, **kwargs):
    return static_buffer(self)


def _viewless_on_tape(original):
    def kernel(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        if not graph_capturing():
            return original(inp, requires_grad)
        out = torch.empty((0,), dtype=inp.dtype, device=inp.device)
        out.set_(inp.untyped_storage(), inp.storage_offset(), inp.size(), inp.stride())
        return out.requires_grad_(requires_grad)

    kernel.original = original
    return kernel


def install_full_iteration_shims() -> None:
    """See the module docstring; a no-op where torch sees CUDA (the real API serves the wrapper)."""
    if torch.cuda.is_available():
        return
    from megatron.core import utils

    if not hasattr(utils._kernel_make_viewless_tensor, "original"):
        utils._kernel_make_viewless_tensor = _viewless_on_tape(utils._kernel_make_viewless_tensor)
    torch.cuda.CUDAGraph = TapeCUDAGraph
    torch.cuda.graph = _API.graph
    torch.cuda.graph_pool_handle = _API.graph_pool_handle
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.is_current_stream_capturing = graph_capturing
    torch.Tensor.cuda = _cuda_on_tape


def reset_wrapper_state(wrapper) -> None:
    """Dev's wrapper keeps its graphs, iteration counts, static buffers and shared pool in class
    and module attributes, shared by every wrapper of the process: after a run, the next one
    (several runs share a harness process) must start from none of them."""
    from megatron.core import full_cuda_graph

    wrapper.reset_cuda_graph()  # dev's own: graphs, results, iteration counts
    for buffers in full_cuda_graph.StaticBufferLoader.static_buffers.values():
        buffers.clear()
    full_cuda_graph._shared_graph_pool = None
