from mhc_cg.model.gpt import *  # noqa
from mhc_cg.model.gpt import MHCGPT, MHCGPTConfig, MLP, MoEMLP, MHCSublayer, HyperConnectionSteps, sublayer_forward, recomputes_activation, MHCTransformerLayer  # noqa
