"""The ``torch.cuda`` graph API, served by one of mhc_cg's graph backends.

Code written for CUDA graphs (TransformerEngine's ``make_graphed_callables``, Megatron-LM's
``FullCudaGraphWrapper``) calls ``torch.cuda.CUDAGraph``, ``torch.cuda.graph(pool=...)``,
``graph_pool_handle``, streams, ``synchronize`` and the RNG state. :class:`CudaAPI` answers those
names for a backend whose graphs are not ``torch.cuda`` graphs: the ``tape`` (the CPU emulation)
or the cost model's recording backend. Everything else it passes on to ``torch.cuda``.

How it reaches that code, without changing ``torch.cuda`` for anyone else: :func:`torch_with`
makes a stand-in for the ``torch`` module whose ``cuda`` is a :class:`CudaAPI`, and a module
loaded with it as its ``torch`` global (:mod:`mhc_cg.graphs.te`) calls the backend. The
Megatron harness, whose processes run megatron-core's CUDA-first code whole, puts the same names
on ``torch.cuda`` itself (:mod:`mhc_cg.lab.megatron_harness.full_iteration_on_tape`).

What a CUDA capture does that a backend's capture alone does not, :class:`BackendCUDAGraph` does
around it (:class:`_HostStaysOnHost`): on a GPU ``torch.get_rng_state()`` is a CPU tensor, and
what is computed from it alone (megatron's RNG tracker compares the CPU generator's state before
and after a ``fork``, ``.item()`` included) runs on the host once, at capture, outside the graph.
On the tape the one device is the CPU, which cannot tell: inside a capture those tensors are
marked and every op on them alone runs unrecorded.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from mhc_cg.core.storage import storage_id
from mhc_cg.graphs.capture import GraphBackend, Pool, graph_capturing


class _HostStaysOnHost(TorchDispatchMode):
    """Inside a capture, under the backend's own recorder: the host's tensors (torch's CPU
    generator state) kept off the graph (see the module docstring)."""

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
            # host work: a CUDA capture runs it on the host once and records nothing
            with _disable_current_modes():
                out = func(*args, **kwargs)
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.host.add(storage_id(o))
                    self._host_refs.append(o)
            return out
        return func(*args, **kwargs)


class BackendCUDAGraph:
    """``torch.cuda.CUDAGraph`` over ``backend``: ``capture_begin(pool)`` / ``capture_end()``
    record on one of its graphs, ``replay()`` replays it, ``register_generator_state`` does
    nothing (no generator is drawn from inside a capture: the capture guard refuses it).
    ``graph``: the backend's graph once captured."""

    backend: GraphBackend  # both set by the subclass :class:`CudaAPI` makes
    captured: list[weakref.ref]  # every graph of that API, in capture order (held by their users)

    def __init__(self, keep_graph: bool = False):
        self.graph = None
        self._capture = None
        self._host: _HostStaysOnHost | None = None

    def register_generator_state(self, state) -> None:
        """Nothing to register: no generator is drawn from inside a capture here."""

    def capture_begin(self, pool: Pool | None = None, capture_error_mode: str = "global",
                      **kwargs) -> None:
        if self.graph is not None:
            raise RuntimeError("CUDAGraph: capture_begin on a graph already captured; make a new "
                               "torch.cuda.CUDAGraph()")
        if pool is not None and not isinstance(pool, self.backend.pool_type):
            raise TypeError(f"CUDAGraph on the {self.backend.name} backend: pool must come from "
                            f"its torch.cuda.graph_pool_handle(), got {type(pool).__name__}")
        self.graph = self.backend.new_graph(pool=pool)
        self.captured.append(weakref.ref(self))
        self._capture = self.graph.capture()
        self._capture.__enter__()
        self._host = _HostStaysOnHost()
        self._host.__enter__()

    def capture_end(self, *exc_info) -> None:
        host, capture = self._host, self._capture
        self._host = self._capture = None
        host.__exit__(None, None, None)
        capture.__exit__(*(exc_info or (None, None, None)))

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError("CUDAGraph: replay() before a capture")
        self.graph.replay()

    def reset(self) -> None:
        self.graph = None

    def pool(self):
        return None if self.graph is None else self.graph.pool

    @property
    def replays(self) -> int:
        return 0 if self.graph is None else self.graph.replays


class _CaptureOn:
    """``torch.cuda.graph(cuda_graph, pool=None, stream=None, capture_error_mode=...)`` over a
    :class:`BackendCUDAGraph`; the stream and error mode mean nothing off a GPU."""

    def __init__(self, cuda_graph: BackendCUDAGraph, pool=None, stream=None,
                 capture_error_mode: str = "global", **kwargs):
        if not isinstance(cuda_graph, BackendCUDAGraph):
            raise TypeError(f"torch.cuda.graph here takes a torch.cuda.CUDAGraph() of the same "
                            f"API, got {type(cuda_graph).__name__}")
        self.cuda_graph, self.pool = cuda_graph, pool

    def __enter__(self) -> None:
        self.cuda_graph.capture_begin(self.pool)

    def __exit__(self, *exc_info) -> None:
        self.cuda_graph.capture_end(*exc_info)


# one stream and event with nothing to wait on: every op runs in order here
HOST_EVENT = types.SimpleNamespace(synchronize=lambda: None, wait=lambda stream=None: None,
                                   record=lambda stream=None: None, query=lambda: True)
HOST_STREAM = types.SimpleNamespace(wait_event=lambda event: None,
                                    wait_stream=lambda stream: None, synchronize=lambda: None,
                                    record_event=lambda event=None: HOST_EVENT,
                                    __enter__=lambda: None, __exit__=lambda *exc: None)


class HostStream:
    """``torch.cuda.Stream`` off a GPU: a type (code writes ``torch.cuda.Stream | None``), and
    making one gives the one host stream."""

    def __new__(cls, *args, **kwargs):
        return HOST_STREAM


class HostEvent:
    """``torch.cuda.Event`` off a GPU: making one gives the one host event."""

    def __new__(cls, *args, **kwargs):
        return HOST_EVENT


class _DeviceProperties:
    """What code asks of the device to choose a path: compute capability 9.0 (the H100 and the
    H200 this project runs on), so a choice made here is the one made there."""

    major, minor, name = 9, 0, "graphs off a GPU (compute capability 9.0 assumed)"
    total_memory = 0
    multi_processor_count = 132


class _DefaultGenerators:
    """``torch.cuda.default_generators[torch.cuda.current_device()]``: the CPU's generator, the
    one dropout draws from off a GPU."""

    def __getitem__(self, index):
        return torch.default_generator

    def __len__(self) -> int:
        return 1


class CudaAPI(types.ModuleType):
    """``torch.cuda`` as code written for CUDA graphs sees it, over ``backend``: the graph, pool,
    stream, RNG and device-query names served here, every other name ``torch.cuda``'s."""

    def __init__(self, backend: GraphBackend):
        super().__init__("torch.cuda", f"torch.cuda over mhc_cg's {backend.name} backend")
        self.backend = backend
        self.captured: list[weakref.ref] = []  # what code captured through this API
        self.CUDAGraph = type("CUDAGraph", (BackendCUDAGraph,),
                              {"backend": backend, "captured": self.captured})
        self.graph = _CaptureOn
        self.graph_pool_handle = backend.new_pool
        self.Stream = HostStream
        self.Event = HostEvent
        self.current_stream = lambda device=None: HOST_STREAM
        self.stream = lambda stream=None: contextlib.nullcontext()
        self.synchronize = lambda device=None: None
        self.empty_cache = lambda: None
        self.current_device = lambda: 0
        self.device_count = lambda: 1
        self.is_available = lambda: False
        self.is_current_stream_capturing = self.capturing
        self.default_generators = _DefaultGenerators()
        self.get_rng_state = lambda device="cuda": torch.get_rng_state()
        self.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
        self.get_device_properties = lambda device=None: _DeviceProperties()
        self.get_device_capability = lambda device=None: (9, 0)
        self.is_bf16_supported = lambda *args, **kwargs: True
        self.nvtx = types.SimpleNamespace(range=lambda *a, **k: contextlib.nullcontext(),
                                          range_push=lambda *a, **k: None,
                                          range_pop=lambda *a, **k: None)

    def capturing(self) -> bool:
        """Whether a graph of this API is being captured (the recorder's own dispatch mode is
        not on the stack while an op it records runs, so the stack cannot tell)."""
        return any(g is not None and g._capture is not None for g in self.graphs()) \
            or graph_capturing()

    def graphs(self, since: int = 0) -> list[BackendCUDAGraph]:
        """The graphs captured through this API (from the ``since``-th on) that are still held."""
        return [g for g in (ref() for ref in self.captured[since:]) if g is not None]

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class TorchWith(types.ModuleType):
    """The ``torch`` module with another ``cuda``: every other name is torch's own."""

    def __init__(self, cuda: types.ModuleType):
        super().__init__("torch", "torch, its cuda served by mhc_cg's graphs")
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def torch_with(backend: GraphBackend) -> TorchWith:
    """``torch`` for a module that should capture on ``backend`` (see the module docstring)."""
    return TorchWith(CudaAPI(backend))
