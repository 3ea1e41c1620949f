"""What a run captures through: one ``make_graphed_callables`` of TransformerEngine's signature,
TE's own or mhc_cg's, and the backend whose graphs share its pools.

``graph.backend: te`` means TE's own function. On a GPU with TransformerEngine installed it is
the installed TE's (:func:`installed_te`); elsewhere the lab serves TE's own Python from its wheel
over the tape or the cost model's recording backend (:mod:`mhc_cg.lab.emulation.backends`,
Note [TE's graph.py from its wheel]), and hands it in as a :class:`TEGraph` whose ``cuda`` is the
``torch.cuda`` its graphs are captured through. ``tape`` and ``cuda`` mean mhc_cg's function,
TE's drop-in (:mod:`mhc_cg.graphs.graphed_callables`). Either way the runtime captures graphs of
its own (the block recompute) into the same pools through :attr:`GraphAPI.backend`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import types
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mhc_cg.core.storage import storage_id

from mhc_cg.graphs.capture import GraphBackend, Pool
from mhc_cg.graphs.cuda import CudaBackend
from mhc_cg.graphs.graphed_callables import (GraphedCallables, GraphOptions,
                                             _distinct_input_sets, flat_tensors,
                                             make_graphed_callables)


def te_installed() -> bool:
    """An installed TransformerEngine (never imported here): one ``transformer_engine`` is
    found that is not the Megatron harness's module tree for it (``te_on_tape``)."""
    spec = importlib.util.find_spec("transformer_engine")
    return spec is not None and "te_on_tape" not in str(spec.origin)


def source_of(function) -> dict[str, str]:
    """The file a function's code came from and its sha256, read from the code object: a
    wheel's member for code run from a wheel, else the file on disk."""
    filename = function.__code__.co_filename
    head, sep, member = filename.partition(".whl/")
    if sep:
        with zipfile.ZipFile(head + ".whl") as wheel:
            data = wheel.read(member)
    else:
        data = Path(filename).read_bytes()
    return {"file": filename, "sha256": hashlib.sha256(data).hexdigest()}


@dataclasses.dataclass(frozen=True)
class TEGraph:
    """TE's graph module, where it came from (``installed`` or ``wheel``) and its version;
    ``cuda``: the ``torch.cuda`` its graphs are captured through where a backend of mhc_cg's
    serves it (its ``captured`` graphs are then seen), ``None`` for torch's own."""

    module: types.ModuleType
    origin: str
    version: str
    cuda: Any = None


def installed_te() -> TEGraph:
    """The installed TransformerEngine's graph module (on a GPU)."""
    import transformer_engine
    import transformer_engine.pytorch.graph as graph

    return TEGraph(graph, "installed", str(transformer_engine.__version__))


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
        cuda = self.te.cuda or torch.cuda
        ours = self.te.cuda is not None  # off a GPU: TE's graphs are seen
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
    """The API of a resolved ``name`` on a GPU: ``cuda`` (mhc_cg's function over CUDA graphs) or
    ``te`` (the installed TE's). ``backend``: the CUDA backend to capture on (default a new one).
    The tape and TE's wheel are the lab's (:func:`mhc_cg.lab.emulation.backends.graph_api`)."""
    if name == "cuda" or (name == "te" and te_installed()):
        backend = backend if backend is not None else CudaBackend()
        if backend.name == "cuda":
            return GraphAPI(backend, installed_te() if name == "te" else None)
    raise ValueError(f"capture API {name!r} over {getattr(backend, 'name', 'no backend')}: off a "
                     f"GPU the graphs are the lab's emulation (mhc_cg.lab.emulation.backends."
                     f"graph_api)")
