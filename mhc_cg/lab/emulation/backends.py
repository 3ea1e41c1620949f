"""Which capture backend a run uses, and making it: ``get_backend(name)``.

``auto`` follows the device the model runs on: TransformerEngine where it is installed and the
device is CUDA, plain ``torch.cuda.CUDAGraph`` on CUDA without TE, the ``tape`` emulation on the
CPU. ``te`` is TransformerEngine's own ``make_graphed_callables`` (:mod:`mhc_cg.graphs.te`):
installed, or from its wheel, over ``torch.cuda`` graphs on CUDA and over the tape on the CPU. The
primitives themselves (:mod:`~mhc_cg.lab.emulation.tape`, :mod:`~mhc_cg.graphs.cuda`)
implement :mod:`mhc_cg.graphs.capture`. The product knows CUDA and the installed TE alone
(:func:`mhc_cg.graphs.te.graph_api`); this module, the lab's, names every backend and makes the
API of any (:func:`graph_api`), which a resolved run carries.
"""

from __future__ import annotations

import torch

from mhc_cg.config.choices import GRAPH_BACKENDS
from mhc_cg.graphs.capture import GraphBackend
from mhc_cg.graphs.te import GraphAPI, te_installed
from mhc_cg.lab.emulation.te_wheel import find_te_wheel, te_graph, te_missing_reason


def te_python() -> str | None:
    """Where TE's graph code would come from here: ``installed`` (on CUDA), ``wheel``, or None."""
    if torch.cuda.is_available() and te_installed():
        return "installed"
    wheel = find_te_wheel()
    return "wheel" if wheel is not None and wheel.is_file() else None


def resolve_backend_name(name: str, device: "str | torch.device | None" = None, *,
                         on_this_machine: bool = True) -> str:
    """The backend ``name`` stands for on ``device`` (default: CUDA when this torch sees a GPU).

    ``auto`` -> ``te`` where TE is installed and the device is CUDA, ``cuda`` on CUDA without TE,
    ``tape`` on the CPU: graphs follow the device the model runs on, not only the machine.
    ``cuda`` is refused for a CPU ``device``; ``te`` runs on either (TE's function over the tape
    on the CPU). ``on_this_machine`` also refuses ``cuda`` where this torch sees no GPU and ``te``
    where no TE (installed, or its wheel) is at hand (off for checking a config meant elsewhere).
    """
    if name not in GRAPH_BACKENDS:
        raise ValueError(f"graph backend must be one of {list(GRAPH_BACKENDS)}, got {name!r}")
    known = device is not None and str(device) != "auto"
    on_cuda = torch.device(device).type == "cuda" if known else torch.cuda.is_available()
    if name == "auto":
        return ("te" if te_installed() else "cuda") if on_cuda else "tape"
    if known and name == "cuda" and not on_cuda:
        raise ValueError("'cuda' captures CUDA graphs, but the model runs on the CPU; use 'tape' "
                         "(the CPU emulation), 'te' (TransformerEngine's function over it) or "
                         "'auto'")
    if on_this_machine and name == "cuda" and not torch.cuda.is_available():
        raise ValueError("'cuda' captures CUDA graphs, but this torch build sees no CUDA GPU; "
                         "use 'tape' (the CPU emulation) or 'auto'")
    if on_this_machine and name == "te" and te_python() is None:
        raise ValueError(f"'te' needs TransformerEngine's Python, installed or its wheel: "
                         f"{te_missing_reason()}")
    return name


def primitive_of(name: str) -> str:
    """The graphs a resolved backend ``name`` captures: ``te``'s are ``torch.cuda`` graphs on a
    GPU and the tape's off one."""
    if name != "te":
        return name
    return "cuda" if torch.cuda.is_available() else "tape"


def get_backend(name: str = "auto") -> GraphBackend:
    """The primitive of ``name`` (:func:`resolve_backend_name`, :func:`primitive_of`)."""
    resolved = primitive_of(resolve_backend_name(name, on_this_machine=False))
    if resolved == "tape":
        from mhc_cg.lab.emulation.tape import TapeBackend
        return TapeBackend()
    from mhc_cg.graphs.cuda import CudaBackend
    return CudaBackend()


def graph_api(name: str, backend: GraphBackend | None = None) -> GraphAPI:
    """The API of a resolved ``name`` (``tape``, ``cuda`` or ``te``) anywhere: on the tape off a
    GPU, TE's function from its wheel where TE is not installed; ``backend``: the primitive to
    capture on instead of the name's own (the cost model's recording backend)."""
    primitive = backend if backend is not None else get_backend(name)
    return GraphAPI(primitive, te_graph(primitive) if name == "te" else None)
