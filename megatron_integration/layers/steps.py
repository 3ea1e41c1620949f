"""A megatron-core mHC layer seen as ``mhc_cg.model.MHCSublayer``'s named steps.

mhc_cg's runtimes (the plain sublayer, eager block recompute, the static-buffer runtime) call a
sublayer through its steps: ``mappings``, ``aggregate``, ``norm``, ``fn``, ``h_res_step``,
``post_bda`` and ``cfg``. These adapters present megatron's parts
under those names, so every runtime runs megatron's modules unchanged and no mHC logic is
written twice. They are plain objects, not modules: they point at the layer, never own it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

from torch import Tensor

from mhc_cg.model import HyperConnectionSteps


class SublayerSteps(HyperConnectionSteps):
    """The attention or MLP sublayer of an ``MegatronMHCTransformerLayer``."""

    def __init__(self, layer, which: str):
        self.layer = layer
        self.hc = layer.attention_hc if which == "attention" else layer.mlp_hc
        self.norm = layer.input_layernorm if which == "attention" else layer.pre_mlp_layernorm
        self.stream = 0 if which == "attention" else 1
        config = layer.config
        self.cfg = SimpleNamespace(dropout_impl=config.mhc_dropout_impl,
                                   hidden_dropout=layer.hidden_dropout,
                                   num_streams=config.num_residual_streams,
                                   hidden_size=config.hidden_size)
        self.fn: Callable[[Tensor], Tensor] | None = None  # bound per forward (LayerSteps.bind)

    def post_bda(self, y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None) -> Tensor:
        return self.layer.mhc_post_bda(y, h_post, mixed, seed, self.stream)


class LayerSteps:
    """Both sublayers of an ``MegatronMHCTransformerLayer``; ``bind`` sets this forward's F arguments.

    Subclasses adapt other layers by naming their ``sublayer_type`` and overriding ``bind``.
    """

    sublayer_type = SublayerSteps

    def __init__(self, layer, attention_mask: Tensor | None = None, **kwargs):
        self.layer = layer
        self.layer_number = layer.layer_number
        self.attention = self.sublayer_type(layer, "attention")
        self.mlp = self.sublayer_type(layer, "mlp")
        self.bind(attention_mask, **kwargs)

    def bind(self, attention_mask: Tensor | None = None, **kwargs) -> "LayerSteps":
        self.attention.fn, self.mlp.fn = self.layer.sublayer_fns(attention_mask, kwargs)
        return self

    @property
    def stream_sublayers(self) -> tuple:
        """``(k, sublayer)`` in stream order (:class:`mhc_cg.runtime.chunk.ChunkLayout`)."""
        return ((0, self.attention), (1, self.mlp))

    def parameters(self):
        return self.layer.parameters()
