"""The mHC GPT: F's layers (:mod:`~mhc_cg.model.layers`), MoE (:mod:`~mhc_cg.model.moe`), one
residual branch as named steps (:mod:`~mhc_cg.model.sublayer`) and the GPT
(:mod:`~mhc_cg.model.gpt`). It runs plainly; recompute is the runtime's."""

from mhc_cg.config import MHCGPTConfig
from mhc_cg.model.gpt import MHCGPT, MHCTransformerLayer, lm_loss, microbatch_loss
from mhc_cg.model.layers import MLP, CausalSelfAttention, RMSNorm, writes_output_into
from mhc_cg.model.moe import MoEMLP
from mhc_cg.model.sublayer import (HyperConnectionSteps, MHCSublayer, hands_state, run_chain,
                                   sublayer_forward)

__all__ = ["CausalSelfAttention", "HyperConnectionSteps", "MHCGPT", "MHCGPTConfig",
           "MHCSublayer", "MHCTransformerLayer", "MLP", "MoEMLP", "RMSNorm",
           "hands_state", "lm_loss", "microbatch_loss", "run_chain",
           "sublayer_forward", "writes_output_into"]
