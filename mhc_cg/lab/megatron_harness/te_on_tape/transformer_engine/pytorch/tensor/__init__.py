"""``transformer_engine.pytorch.tensor``: the quantized tensor base Megatron checks against (no
tensor here is one: FP8 is off)."""

import torch


class QuantizedTensor(torch.Tensor):
    """``isinstance`` target only."""
