"""TE's module base class, for ``isinstance`` checks: the stand-in has no TE modules."""

import torch


class TransformerEngineBaseModule(torch.nn.Module):
    """No module derives from it here, so megatron finds no TE module to give FP8 metadata."""
