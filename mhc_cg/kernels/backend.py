"""Which implementation a fused op runs: ``model.kernels`` (``auto | torch | triton``) and a device.

``auto`` is Triton on CUDA (when the ``triton`` package is installed) and the torch reference
elsewhere. ``triton`` on a CPU tensor runs only in Triton's interpreter (``TRITON_INTERPRET=1``):
Triton reads that variable when it decorates a kernel, so ``triton_kernels()`` re-imports the
kernel module whenever the variable no longer matches the one the module was built under.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import torch

from mhc_cg.errors import ConfigError

KERNELS = ("auto", "torch", "triton")
_MODULE = "mhc_cg.kernels.triton_kernels"


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
    return True


def triton_kernels():
    """The Triton kernel module, built for the current ``TRITON_INTERPRET`` setting."""
    module = sys.modules.get(_MODULE)
    if module is None:
        return importlib.import_module(_MODULE)
    if module.INTERPRETED != interpret_requested():
        return importlib.reload(module)
    return module
