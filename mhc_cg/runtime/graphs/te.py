"""What a run captures through: one ``make_graphed_callables`` of TransformerEngine's signature,
TE's own or mhc_cg's, and the backend whose graphs share its pools.

``graph.backend: te`` means TE's own function: the installed TransformerEngine's on a GPU where
it is installed, else the one in TE's wheel (Note [TE's graph.py from its wheel]), over
``torch.cuda`` graphs on a GPU and over the tape on a CPU (the tape serves the ``torch.cuda``
calls TE's code makes: :mod:`mhc_cg.runtime.graphs.cuda_api`), or over the cost model's
recording backend. ``tape`` and ``cuda`` mean mhc_cg's function, TE's drop-in
(:mod:`mhc_cg.runtime.graphs.graphed_callables`). Either way the runtime captures graphs of its own
(the block recompute) into the same pools through :attr:`GraphAPI.backend`.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mhc_cg.core.storage import storage_id

from mhc_cg.runtime.graphs.capture import GraphBackend, Pool
from mhc_cg.runtime.graphs.cuda_api import CudaAPI, torch_with
from mhc_cg.runtime.graphs.graphed_callables import (GraphedCallables, GraphOptions,
                                                     _distinct_input_sets, flat_tensors,
                                                     make_graphed_callables)
from mhc_cg.runtime.graphs.te_wheel import (find_te_wheel, source_of, te_installed,
                                            te_missing_reason, te_wheel)


@dataclasses.dataclass(frozen=True)
class TEGraph:
    """TE's graph module, where it came from (``installed`` or ``wheel``) and its version."""

    module: types.ModuleType
    origin: str
    version: str


def te_graph(backend: GraphBackend) -> TEGraph:
    """TE's ``graph.py`` capturing on ``backend``: the installed TE's on CUDA, else the wheel's
    (its ``torch.cuda`` served by ``backend`` off a GPU). Raises ValueError, saying how to get
    it, where neither is at hand."""
    if backend.name == "cuda" and te_installed():
        import transformer_engine
        import transformer_engine.pytorch.graph as graph

        return TEGraph(graph, "installed", str(transformer_engine.__version__))
    wheel = find_te_wheel()
    if wheel is None or not wheel.is_file():
        raise ValueError(f"graph.backend 'te' needs TransformerEngine's Python: installed with "
                         f"its CUDA extension, or its wheel; {te_missing_reason()}")
    loaded = te_wheel(str(wheel))
    module = loaded.graph_module(None if backend.name == "cuda" else torch_with(backend))
    return TEGraph(module, "wheel", loaded.version)


class GraphAPI:
    """``make_graphed_callables`` (TE's signature) and ``backend``, the primitive the runtime
    captures its own graphs with, in the same pools. ``te``: TE's graph module, or ``None`` for
    mhc_cg's function over ``backend``."""

    def __init__(self, backend: GraphBackend, te: TEGraph | None = None):
        self.backend, self.te = backend, te

    @property
    def name(self) -> str:
        return "te" if self.te is not None else self.backend.name

    @property
    def function(self) -> Callable:
        """The function that captures: TE's, or mhc_cg's."""
        return make_graphed_callables if self.te is None else self.te.module.make_graphed_callables

    def source(self) -> dict[str, str]:
        """The capturing function's file and sha256 (read from its code object), and for TE its
        origin and version."""
        found = source_of(self.function)
        if self.te is not None:
            found.update(origin=self.te.origin, version=self.te.version)
        return found

    def new_pool(self) -> Pool:
        return self.backend.new_pool()

    def handle(self, pool: Pool | None) -> Any:
        """What ``pool`` is to the capturing function: TE on a GPU takes torch's pool handle."""
        if pool is None or self.te is None or self.backend.name != "cuda":
            return pool
        return pool.handle

    def make_graphed_callables(self, modules, sample_args, *, options: GraphOptions | None = None,
                               pool: Pool | None = None, **kwargs) -> Any:
        """Graph ``modules`` with the function of this API, in ``pool`` (a pool of
        :attr:`backend`; default a new one). ``kwargs``: TE's arguments. ``options``: what only
        mhc_cg's function does (:class:`GraphOptions`); TE's goes without it (a forward scratch
        is then not made: the caller asks :meth:`GraphedCallables.scratch`, which says None)."""
        pool = self.new_pool() if pool is None else pool
        if self.te is None:
            options = dataclasses.replace(options or GraphOptions(), backend=self.backend)
            return make_graphed_callables(modules, sample_args, pool=pool, options=options,
                                          **kwargs)
        cuda = self.te.module.torch.cuda
        ours = isinstance(cuda, CudaAPI)  # off a GPU: TE's graphs are seen
        start = len(cuda.captured) if ours else 0
        with _Allocations(cuda.is_current_stream_capturing) as allocated:
            result = self.function(modules, sample_args, pool=self.handle(pool), **kwargs)
        if not isinstance(modules, tuple):
            return result
        # TE rewrote sample_args in place where it shared buffers
        samples = kwargs.get("sample_kwargs") or [{} for _ in sample_args]
        inputs = [flat_tensors(a, k) for a, k in zip(sample_args, samples)]
        return GraphedCallables(result, backend="te", pool=pool, states=None,
                                static_input_sets=_distinct_input_sets(inputs),
                                captured=[cg.graph for cg in cuda.graphs(start)] if ours else [],
                                static_tensors=[t for ts in inputs for t in ts]
                                + allocated.alive())


class _Allocations(TorchDispatchMode):
    """The storages ops make outside any capture while TE's function runs, and which of them
    are still alive after it: the static buffers TE keeps outside its pool (its grad-output
    buffers), which the cost model counts as ours."""

    def __init__(self, capturing: Callable[[], bool]):
        super().__init__()
        self.capturing = capturing
        self._made: list[tuple[StorageWeakRef, torch.dtype, torch.device]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.capturing():
            inputs = {storage_id(t) for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and storage_id(t) not in inputs:
                    self._made.append((StorageWeakRef(t.untyped_storage()), t.dtype, t.device))
        return out

    def alive(self) -> list[torch.Tensor]:
        """A tensor over each storage made that is still held, once each."""
        found = {}
        for ref, dtype, device in self._made:
            if not ref.expired():
                found.setdefault(ref.cdata, (dtype, device))
        self._made.clear()
        return [torch.empty(0, dtype=dtype, device=device).set_(
            torch.UntypedStorage._new_with_weak_ptr(cdata)) for cdata, (dtype, device)
            in found.items()]


def graph_api(name: str, backend: GraphBackend | None = None) -> GraphAPI:
    """The API of a resolved backend ``name`` (``tape``, ``cuda`` or ``te``); ``backend``: the
    primitive to capture on instead of the name's own (the cost model's recording backend)."""
    from mhc_cg.runtime.graphs.backends import get_backend

    primitive = backend if backend is not None else get_backend(name)
    return GraphAPI(primitive, te_graph(primitive) if name == "te" else None)
