"""mhc_cg: CUDA-Graph-compatible activation recompute for mHC transformer blocks."""

from mhc_cg.ops.hyper_connection import HyperConnection, contract_streams, expand_streams, sinkhorn_knopp
from mhc_cg.model import MHCGPT, MHCGPTConfig

__all__ = ["HyperConnection", "MHCGPT", "MHCGPTConfig", "contract_streams", "expand_streams",
           "sinkhorn_knopp"]
__version__ = "0.2.0"
