"""Which implementation a fused op runs: ``model.kernels`` (``auto | torch | triton``) and a device.

``auto`` is Triton on CUDA (when the ``triton`` package is installed) and the torch reference
elsewhere. ``triton`` on a CPU tensor runs only in Triton's interpreter: ``TRITON_INTERPRET=1``
must be set before triton is first imported (Triton decides when it decorates a function,
``triton.language``'s own included, whether it is compiled or interpreted).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

from mhc_cg.core.errors import ConfigError

KERNELS = ("auto", "torch", "triton")
_MODULE = "mhc_cg.ops.kernels.triton_kernels"


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_problem(kernels, cuda: bool) -> str | None:
    """One line naming ``model.kernels`` and the fix, or None when ``kernels`` can run."""
    if kernels not in KERNELS:
        return f"model.kernels: must be one of {list(KERNELS)}, got {kernels!r}"
    if kernels != "triton":
        return None
    if not triton_installed():
        return "model.kernels: 'triton' needs the triton package; pip install triton, or set model.kernels: torch"
    if not cuda and not interpret_requested():
        return ("model.kernels: 'triton' on CPU runs only in Triton's interpreter; set the environment "
                "variable TRITON_INTERPRET=1, or set model.kernels: auto (torch on CPU)")
    return None


def use_triton(kernels: str, device: torch.device) -> bool:
    """Whether the fused ops run Triton for tensors on ``device``; raises ``ConfigError`` if they cannot."""
    if kernels == "torch":
        return False
    if kernels == "auto":
        return device.type == "cuda" and triton_installed()
    problem = kernels_problem(kernels, device.type == "cuda")
    if problem:
        raise ConfigError(problem)
    if device.type != "cuda" and not triton_kernels().INTERPRETED:
        raise ConfigError("model.kernels: 'triton' on CPU needs TRITON_INTERPRET=1 set before triton "
                          "is imported; set it in the environment of the process")
    return True


def triton_kernels():
    """The Triton kernel module (imported on first use, so ``import mhc_cg`` never needs triton)."""
    module = importlib.import_module(_MODULE)
    return module
