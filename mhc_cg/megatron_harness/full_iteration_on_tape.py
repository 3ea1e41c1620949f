"""The CUDA graph API Megatron-LM dev's ``FullCudaGraphWrapper`` calls, served by mhc_cg's tape.

``megatron.core.full_cuda_graph.FullCudaGraphWrapper`` (``cuda_graph_impl: full_iteration``)
runs ``cuda_graph_warmup_steps`` iterations eagerly, then captures every microbatch's forward
and backward (pipeline sends and receives included) in one ``torch.cuda.CUDAGraph`` and replays
it from then on, its batches copied into static buffers first (``StaticBufferLoader``). On a CPU
build of torch none of that API exists; :func:`install_full_iteration_shims` puts, for the rest of
a harness process and only without CUDA, the tape behind every name the wrapper uses:

* ``torch.cuda.CUDAGraph`` -> :class:`TapeCUDAGraph`: ``capture_begin(pool)`` /
  ``capture_end()`` record the body on a tape graph (``mhc_cg.runtime.graphs.get_backend("tape")``),
  ``replay()`` replays it, ``register_generator_state`` does nothing (on the tape no generator
  may be drawn from inside a capture: the capture guard refuses it);
* ``torch.cuda.graph`` -> :class:`tape_graph`, the same context manager over it;
* ``torch.cuda.graph_pool_handle`` -> a new tape pool;
* ``torch.cuda.synchronize``, ``torch.cuda.empty_cache`` -> nothing to do (the CPU runs every op
  in order; the tape returns no memory);
* ``torch.cuda.is_current_stream_capturing`` -> whether a tape capture is running;
* ``Tensor.cuda`` -> the tensor itself, registered as a static buffer
  (:func:`mhc_cg.runtime.graphs.static_inputs.static_buffer`): the CPU is the tape's device, and
  what a GPU run copies to the device (the wrapper's static batch buffers, a 0-dim dropout seed
  among them) is device memory a replay reads where it lies, not a host scalar the tape bakes.

``torch.cuda.Stream``/``stream``/``current_stream`` are :mod:`mhc_cg.megatron_harness.megatron_on_cpu`'s.

A capture runs nothing, on the tape as with CUDA (the tape puts back what it wrote outside its
pool: Note [a capture runs nothing]), so dev's wrapper, which replays right after capturing,
counts the captured iteration once. What a CUDA capture does that the tape alone does not,
:class:`TapeCUDAGraph` does around the tape's capture (:class:`_CaptureOnTape`, a dispatch mode
under the tape's recorder):

* **Host tensors stay on the host.** On a GPU, ``torch.get_rng_state()`` is a CPU tensor, and
  what is computed from it alone (megatron's RNG tracker compares the CPU generator's state
  before and after a ``fork``, ``.item()`` included) runs on the host once, at capture, outside
  the graph. The tape's one device is the CPU and it cannot tell; inside a capture those tensors
  are marked and every op on them alone runs unrecorded.

(``x[mask] = scalar``, which megatron's cross entropy and vocab-parallel embedding use, the
capture guard itself records as the masked fill ATen runs: Note [x[mask] = scalar is a masked
fill], :mod:`mhc_cg.runtime.graphs.guard`.)

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
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from mhc_cg.core.storage import storage_id
from mhc_cg.runtime.graphs import get_backend, graph_capturing
from mhc_cg.runtime.graphs.static_inputs import static_buffer
from mhc_cg.runtime.graphs.tape import TapePool
from mhc_cg.cost.allocator import rounded

_TAPE = get_backend("tape")


class _CaptureOnTape(TorchDispatchMode):
    """Inside a tape capture, under the tape's own recorder, what a CUDA capture does that the tape
    alone does not (see the module docstring): the host's tensors (torch's CPU generator state)
    kept off the graph."""

    def __init__(self):
        super().__init__()
        self.host: set[int] = set()  # storages a GPU run keeps on the host
        self._host_refs: list[torch.Tensor] = []  # alive while their ids are in ``host``
        self._get_rng_state = None

    def __enter__(self):
        original = self._get_rng_state = torch.get_rng_state

        def get_rng_state() -> torch.Tensor:  # a CPU tensor on a GPU machine too
            state = original()
            self.host.add(storage_id(state))
            self._host_refs.append(state)
            return state

        torch.get_rng_state = get_rng_state
        return super().__enter__()

    def __exit__(self, *exc_info):
        torch.get_rng_state = self._get_rng_state
        self._host_refs.clear()
        return super().__exit__(*exc_info)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if tensors and all(storage_id(t) in self.host for t in tensors):
            # host work (megatron's RNG tracker compares the CPU generator's state before and
            # after a fork): a CUDA capture runs it on the host once and records nothing
            with _disable_current_modes():
                out = func(*args, **kwargs)
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.host.add(storage_id(o))
                    self._host_refs.append(o)
            return out
        return func(*args, **kwargs)


class TapeCUDAGraph:
    """``torch.cuda.CUDAGraph`` on the tape (see the module docstring). ``tape``: the tape graph
    once captured; ``replays`` counts its replays."""

    def __init__(self, keep_graph: bool = False):
        self.tape = None
        self._capture = None
        self._writes: _CaptureOnTape | None = None

    def register_generator_state(self, state) -> None:
        """Nothing to register: no generator is drawn from inside a tape capture."""

    def capture_begin(self, pool=None, capture_error_mode: str = "global", **kwargs) -> None:
        if self.tape is not None:
            raise RuntimeError("TapeCUDAGraph: capture_begin on a graph already captured; make "
                               "a new torch.cuda.CUDAGraph()")
        if pool is not None and not isinstance(pool, TapePool):
            raise TypeError(f"TapeCUDAGraph: pool must come from torch.cuda.graph_pool_handle() "
                            f"(a tape pool here), got {type(pool).__name__}")
        self.tape = _TAPE.new_graph(pool=pool)
        self._capture = self.tape.capture()
        self._capture.__enter__()
        self._writes = _CaptureOnTape()
        self._writes.__enter__()

    def capture_end(self, *exc_info) -> None:
        writes, capture = self._writes, self._capture
        self._writes = self._capture = None
        writes.__exit__(None, None, None)
        capture.__exit__(*(exc_info or (None, None, None)))

    def replay(self) -> None:
        if self.tape is None:
            raise RuntimeError("TapeCUDAGraph: replay() before a capture")
        self.tape.replay()

    def reset(self) -> None:
        self.tape = None

    def pool(self):
        return None if self.tape is None else self.tape.pool

    @property
    def replays(self) -> int:
        return 0 if self.tape is None else self.tape.replays

    def collectives(self) -> dict[str, int]:
        """``{c10d op: count}`` the graph holds (a pipeline's sends and receives, all-reduces)."""
        counts: dict[str, int] = {}
        for op in () if self.tape is None else self.tape.ops:
            if op.func.namespace == "c10d":
                counts[op.func.name()] = counts.get(op.func.name(), 0) + 1
        return counts

    def allocated_bytes(self) -> int:
        """Bytes the capture allocated (each storage at its largest, in 512-byte allocator blocks):
        the tape keeps every one for its replays, so this is what the graph's pool holds here; a
        CUDA pool, which hands a block freed during the capture to a later allocation, holds at
        most this many bytes live."""
        if self.tape is None:
            return 0
        made = self.tape.made_storages
        found: dict[int, int] = {}
        for op in self.tape.ops:
            for t in (*op.flat_args, *op.outputs):
                if isinstance(t, torch.Tensor) and storage_id(t) in made:
                    found.setdefault(storage_id(t), t.untyped_storage().nbytes())
        return sum(rounded(n) for n in found.values())


class tape_graph:  # noqa: N801  (torch.cuda.graph's name)
    """``torch.cuda.graph(cuda_graph, pool=None, stream=None, capture_error_mode=...)`` over a
    :class:`TapeCUDAGraph`; the stream and error mode mean nothing on the tape."""

    def __init__(self, cuda_graph: TapeCUDAGraph, pool=None, stream=None,
                 capture_error_mode: str = "global", **kwargs):
        if not isinstance(cuda_graph, TapeCUDAGraph):
            raise TypeError(f"torch.cuda.graph on the tape takes a torch.cuda.CUDAGraph() made "
                            f"after the shims were installed, got {type(cuda_graph).__name__}")
        self.cuda_graph, self.pool = cuda_graph, pool

    def __enter__(self) -> None:
        self.cuda_graph.capture_begin(self.pool)

    def __exit__(self, *exc_info) -> None:
        self.cuda_graph.capture_end(*exc_info)


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
    torch.cuda.graph = tape_graph
    torch.cuda.graph_pool_handle = lambda: _TAPE.new_pool()
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
