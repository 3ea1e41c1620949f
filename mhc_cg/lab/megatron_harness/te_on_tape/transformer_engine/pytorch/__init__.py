"""``transformer_engine.pytorch``: TE's graph API and FP8 autocasts from its wheel; the module
classes Megatron's TE extension subclasses in torch (``module/on_cpu.py``)."""

from transformer_engine.pytorch.fp8 import fp8_autocast, fp8_model_init
from transformer_engine.pytorch.graph import make_graphed_callables
from transformer_engine.pytorch.module.on_cpu import (DotProductAttention, GroupedLinear,
                                                      LayerNorm, LayerNormLinear, Linear, RMSNorm)
from mhc_cg.lab.megatron_harness.te_on_tape.wheel import public

_quantization = public("transformer_engine.pytorch.quantization")
autocast, quantized_model_init = _quantization["autocast"], _quantization["quantized_model_init"]

__all__ = ["DotProductAttention", "GroupedLinear", "LayerNorm", "LayerNormLinear", "Linear",
           "RMSNorm", "autocast", "fp8_autocast", "fp8_model_init", "make_graphed_callables",
           "quantized_model_init"]
