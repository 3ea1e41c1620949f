"""Which capture backend a run uses, and making it: ``get_backend(name)``.

``auto`` follows the device the model runs on: TransformerEngine where it is installed and the
device is CUDA, plain ``torch.cuda.CUDAGraph`` on CUDA without TE, the ``tape`` emulation on the
CPU. The backends themselves (:mod:`~mhc_cg.runtime.graphs.tape`, :mod:`~mhc_cg.runtime.graphs.cuda`,
:mod:`~mhc_cg.runtime.graphs.te`) implement :mod:`mhc_cg.runtime.graphs.capture`.
"""

from __future__ import annotations

import importlib.util

import torch

from mhc_cg.config.choices import GRAPH_BACKENDS
from mhc_cg.runtime.graphs.capture import GraphBackend


def te_available() -> bool:
    """TransformerEngine's PyTorch extension is installed (never imported here)."""
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_backend_name(name: str, device: "str | torch.device | None" = None, *,
                         on_this_machine: bool = True) -> str:
    """The backend ``name`` stands for on ``device`` (default: CUDA when this torch sees a GPU).

    ``auto`` -> ``te`` where TE is installed and the device is CUDA, ``cuda`` on CUDA without TE,
    ``tape`` on the CPU: graphs follow the device the model runs on, not only the machine. With a
    CPU ``device``, ``cuda`` and ``te`` are refused here; ``on_this_machine`` also refuses them
    where this torch sees no GPU or TE is missing (off for checking a config meant elsewhere).
    """
    if name not in GRAPH_BACKENDS:
        raise ValueError(f"graph backend must be one of {list(GRAPH_BACKENDS)}, got {name!r}")
    known = device is not None and str(device) != "auto"
    on_cuda = torch.device(device).type == "cuda" if known else torch.cuda.is_available()
    if name == "auto":
        return ("te" if te_available() else "cuda") if on_cuda else "tape"
    if known and name in ("cuda", "te") and not on_cuda:
        raise ValueError(f"{name!r} captures CUDA graphs, but the model runs on the CPU; use "
                         f"'tape' (the CPU emulation) or 'auto'")
    if on_this_machine and name in ("cuda", "te") and not torch.cuda.is_available():
        raise ValueError(f"{name!r} captures CUDA graphs, but this torch build sees no CUDA GPU; "
                         f"use 'tape' (the CPU emulation) or 'auto'")
    if on_this_machine and name == "te" and not te_available():
        raise ValueError("'te' needs TransformerEngine (transformer_engine), which is not "
                         "installed; install it, or use 'cuda' or 'auto'")
    return name


def get_backend(name: str = "auto") -> GraphBackend:
    """The backend called ``name`` (see :func:`resolve_backend_name` for ``auto``)."""
    resolved = resolve_backend_name(name, on_this_machine=False)  # the backends say why not
    if resolved == "tape":
        from mhc_cg.runtime.graphs.tape import TapeBackend
        return TapeBackend()
    if resolved == "cuda":
        from mhc_cg.runtime.graphs.cuda import CudaBackend
        return CudaBackend()
    from mhc_cg.runtime.graphs.te import TEBackend
    return TEBackend()

