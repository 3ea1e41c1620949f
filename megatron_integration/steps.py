"""A megatron-core mHC layer seen as ``mhc_cg.model.MHCSublayer``'s named steps.

mhc_cg's runtimes (the plain sublayer, eager block recompute, the static-buffer runtime) call a
sublayer through its steps: ``mappings``, ``aggregate``, ``norm``, ``fn``, ``h_res_step``,
``h_post_step``, ``bda``, ``bda_dropout`` and ``cfg``. These adapters present megatron's parts
under those names, so every runtime runs megatron's modules unchanged and no mHC logic is
written twice. They are plain objects, not modules: they point at the layer, never own it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

from torch import Tensor


class SublayerSteps:
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

    def mappings(self, x: Tensor):
        return self.hc.compute_mappings(x)

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        return self.hc.aggregate(x, h_pre)

    def h_res_step(self, h_res: Tensor, x: Tensor) -> Tensor:
        return self.hc.apply_h_res(h_res, x)

    def h_post_step(self, y: Tensor, h_post: Tensor) -> Tensor:
        return self.hc.apply_h_post(y, h_post)

    def bda_dropout(self, post: Tensor, seed: Tensor | None) -> Tensor:
        return self.layer.mhc_dropout(post, seed, self.stream)

    def bda(self, post: Tensor, mixed: Tensor, seed: Tensor | None) -> Tensor:
        return mixed + self.bda_dropout(post, seed)


class LayerSteps:
    """Both sublayers of an ``MegatronMHCTransformerLayer``; ``bind`` sets this forward's F arguments."""

    def __init__(self, layer, attention_mask: Tensor | None = None, **kwargs):
        self.layer = layer
        self.layer_number = layer.layer_number
        self.attention = SublayerSteps(layer, "attention")
        self.mlp = SublayerSteps(layer, "mlp")
        self.bind(attention_mask, **kwargs)

    def bind(self, attention_mask: Tensor | None = None, **kwargs) -> "LayerSteps":
        self.attention.fn, self.mlp.fn = self.layer.sublayer_fns(attention_mask, kwargs)
        return self

    def parameters(self):
        return self.layer.parameters()
