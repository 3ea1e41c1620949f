"""Megatron-LM dev's hybrid stack (``HybridStack``, ``--hybrid-layer-pattern``) on mhc_cg's runtimes.

A hybrid stack's mHC layer, dev's ``HyperConnectionHybridLayer``, is one sublayer: one
hyper-connection module (``hyper_connection``) around one inner ``TransformerLayer`` that holds
an attention (DeepSeek-V4's ``W``, ``C``, ``H``) or an MLP (``-``, ``E``), the other side an
``IdentityOp``. Dev's wrapper feeds the inner branch's raw output into the n-stream
bias-dropout-add of the same ``HyperConnectionModule`` its GPT layer uses, so the steps are dev's
GPT steps (:mod:`megatron_integration.layers.dev_layer`) over the wrapper's hyper-connection and
the inner layer's norm and branch; only the dense MLP's input is not cast first (the wrapper's
path does not cast it).

``MHCHybridLayer`` is dev's wrapper for a training script to name where the hybrid stack builds
it (``megatron.core.models.hybrid.hybrid_block.HyperConnectionHybridLayer``, ``examples/megatron/``):
dev's constructor refuses mHC recompute with CUDA graphs, because dev's own recompute cannot run
inside its graphs; mhc_cg's runtime runs it there, so this one sets up the same fields without
that refusal. Its forward, capture, replay and checkpoint keys are dev's.
"""

from __future__ import annotations

import functools

from megatron_integration.layers.dev_layer import DevFusedSublayer, DevLayerSteps, DevSublayerSteps


def _hybrid_block():
    from megatron.core.models.hybrid import hybrid_block

    return hybrid_block


@functools.cache
def mhc_hybrid_layer() -> type:
    """``MHCHybridLayer``: dev's ``HyperConnectionHybridLayer`` without its refusal of mHC
    recompute under CUDA graphs (see the module docstring); one class per process."""
    from megatron.core.transformer.hyper_connection import HyperConnectionModule
    from megatron.core.transformer.module import (GraphableMegatronModule,
                                                  convert_module_to_dtype_except_fp32_marked)

    base = _hybrid_block().HyperConnectionHybridLayer
    if base.__name__ == "MHCHybridLayer":  # the module names ours already
        return base

    def __init__(self, config, layer) -> None:
        # dev's fields, set as dev's constructor sets them (its refusal left out: mhc_cg's
        # runtime owns the recompute under graphs)
        GraphableMegatronModule.__init__(self, config=config)
        self.inner_layer = layer
        self.layer_number = layer.layer_number
        self.hyper_connection = HyperConnectionModule(config=config,
                                                      layer_number=self.layer_number)
        if config.params_dtype is not None:
            convert_module_to_dtype_except_fp32_marked(self.hyper_connection, config.params_dtype)
        if hasattr(layer, "tp_group"):
            self.tp_group = layer.tp_group

    doc = ("dev's HyperConnectionHybridLayer, its fields set without its refusal of mHC recompute "
           "under CUDA graphs (megatron_integration.layers.hybrid_layer)")
    return type("MHCHybridLayer", (base,), {"__init__": __init__, "__doc__": doc})


def is_hybrid_layer(layer) -> bool:
    """A hybrid stack's mHC wrapper (dev's or ``MHCHybridLayer``)."""
    return hasattr(layer, "inner_layer") and hasattr(layer, "hyper_connection")


def hybrid_sublayer_kind(wrapper) -> int:
    """0 where the wrapper's inner layer is an attention, 1 where it is an MLP or MoE."""
    from megatron.core.transformer.identity_op import IdentityOp

    inner = wrapper.inner_layer
    if not hasattr(inner, "self_attention"):
        raise TypeError(f"hybrid layer {wrapper.layer_number}: a {type(inner).__name__}; mhc_cg's "
                        f"static runtime takes the hybrid stack's TransformerLayers (DeepSeek-V4's "
                        f"W, C, H, -, E), not Mamba or GDN layers")
    attention = not isinstance(inner.self_attention, IdentityOp)
    mlp = not isinstance(inner.mlp, IdentityOp)
    if attention == mlp or not isinstance(inner.cross_attention, IdentityOp):
        raise TypeError(f"hybrid layer {wrapper.layer_number}: its TransformerLayer holds other "
                        f"than one self-attention or one MLP; mhc_cg's static runtime takes "
                        f"one-branch layers, as DeepSeek-V4's hybrid pattern builds them")
    return 0 if attention else 1


class HybridSublayerSteps(DevSublayerSteps):
    """The one sublayer of a hybrid stack's mHC layer, dev's arithmetic."""

    casts_mlp_input = False


class HybridLayerSteps(DevLayerSteps):
    """A hybrid stack's mHC layer as its one sublayer's steps: ``layer`` is the inner
    ``TransformerLayer`` (F's, and what the MoE graph head and tail read), ``wrapper`` the
    hybrid layer (its parameters include the hyper-connection's)."""

    sublayer_type = HybridSublayerSteps

    def __init__(self, wrapper, attention_mask=None, **kwargs):
        self.wrapper, self.layer = wrapper, wrapper.inner_layer
        self.layer_number = wrapper.layer_number
        self.k = hybrid_sublayer_kind(wrapper)
        sub = self.sublayer_type(self.layer, ("attention", "mlp")[self.k],
                                 hc=wrapper.hyper_connection)
        self.attention, self.mlp = (sub, None) if self.k == 0 else (None, sub)
        self.bind(attention_mask, **kwargs)

    @property
    def stream_sublayers(self) -> tuple:
        return ((self.k, self.attention if self.k == 0 else self.mlp),)

    def parameters(self):
        return self.wrapper.parameters()


class HybridFusedLayerSteps(HybridLayerSteps):
    """A hybrid stack's mHC layer on mhc_cg's fused kernels (dev's ``use_fused_mhc``)."""

    sublayer_type = DevFusedSublayer  # dev's fused sublayer: the same hyper-connection module


def hybrid_layer_steps(fused_mhc: bool) -> type[HybridLayerSteps]:
    return HybridFusedLayerSteps if fused_mhc else HybridLayerSteps
