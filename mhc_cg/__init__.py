"""mhc_cg: CUDA-Graph-compatible activation recompute for mHC transformer blocks.

The names below load on first use (PEP 562), so ``import mhc_cg`` and the ``mhc-cg`` command's
parser import no torch; ``from mhc_cg import MHCGPT`` imports the model then.
"""

from __future__ import annotations

import importlib
from typing import Any

# exported name -> the module that defines it
_EXPORTS = {
    "HyperConnection": "mhc_cg.ops.hyper_connection",
    "contract_streams": "mhc_cg.ops.hyper_connection",
    "expand_streams": "mhc_cg.ops.hyper_connection",
    "sinkhorn_knopp": "mhc_cg.ops.hyper_connection",
    "MHCGPT": "mhc_cg.model",
    "MHCGPTConfig": "mhc_cg.model",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mhc_cg' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
