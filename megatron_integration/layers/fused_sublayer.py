"""A sublayer of Megatron-LM's own ``HyperConnectionTransformerLayer`` on mhc_cg's fused kernels.

Megatron's layer keeps its modules and parameters: its hyper-connection module (``mapping_proj``,
``alpha_pre``, ``alpha_post``, ``alpha_res``, ``bias``, read through
:class:`mhc_cg.ops.hyper_connection.KernelsOver` at every call), its norm and its attention or
MLP. Only the mHC arithmetic around F is mhc_cg's: the pre (mappings, aggregate and the norm in
one read of the streams) and the post (``H_res x + dropout(H_post y)`` in one pass), whose
backward kernels give every parameter its gradient. The arithmetic is the branch's: main's for
main's layer, DeepSeek-V4's (``h_pre + 1e-6``, dev's Sinkhorn, ``H_res^T x``) for dev's.

What differs from Megatron's native ops is rounding only: F's bias is added to its output before
H_post (``H_post (y + b)``, where Megatron adds ``H_post y + H_post b``), and the mappings stay
in fp32 where dev casts them to the stream's dtype before applying them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

from torch import Tensor

from mhc_cg.model.sublayer import FusedSteps
from mhc_cg.ops.hyper_connection import KernelsOver

from megatron_integration.layers.counter_dropout import sublayer_stream


class NormParams:
    """What the fused pre needs of a Megatron norm: its ``weight`` (``None`` where the norm is
    not a module of its own: TE's spec fuses it into F's first linear, which then normalises)
    and ``eps``, read from the norm at every call."""

    def __init__(self, norm, config):
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("use_fused_mhc: mhc_cg's fused pre applies the norm as "
                             "x * rstd * weight; set layernorm_zero_centered_gamma=False")
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"use_fused_mhc: mhc_cg's fused pre applies an RMSNorm, the config "
                             f"says normalization={config.normalization!r}; set "
                             f"normalization='RMSNorm'")
        self.norm = norm
        self.default_eps = float(config.layernorm_epsilon)

    @property
    def weight(self) -> Tensor | None:
        return getattr(self.norm, "weight", None)

    @property
    def eps(self) -> float:
        eps = getattr(self.norm, "eps", None)
        return self.default_eps if eps is None else float(eps)


def sublayer_parts(layer, which: str, streams_field: str, hc=None):
    """``(hyper-connection module, norm, cfg, dropout stream)`` of the attention or MLP sublayer
    of a ``HyperConnectionTransformerLayer``, as every step adapter of it reads them. ``hc``:
    the hyper-connection module where it is not the layer's own (a hybrid stack's wrapper holds
    it around its inner ``layer``)."""
    attention = which == "attention"
    config = layer.config
    # Megatron's hyper-connection dropout is torch's (stateful) dropout, unless
    # use_counter_dropout opted the layer in
    counter = getattr(layer, "mhc_counter_dropout", False)
    cfg = SimpleNamespace(dropout_impl="counter" if counter else "torch",
                          hidden_dropout=layer.hidden_dropout,
                          num_streams=getattr(config, streams_field),
                          hidden_size=config.hidden_size)
    if hc is None:
        hc = layer.self_attention_hyper_connection if attention else layer.mlp_hyper_connection
    return (hc, layer.input_layernorm if attention else layer.pre_mlp_layernorm, cfg,
            sublayer_stream(layer.layer_number, 0 if attention else 1))


class MegatronFusedSublayer(FusedSteps):
    """The attention or MLP sublayer of a ``HyperConnectionTransformerLayer`` with the fused ops
    of :class:`mhc_cg.model.sublayer.FusedSteps`; main's arithmetic (dev's: the subclass in
    :mod:`megatron_integration.layers.dev_layer`)."""

    streams_field = "mhc_num_residual_streams"
    arithmetic = "main"
    h_res_transposed = False

    def __init__(self, layer, which: str, hc=None):
        module, norm, self.cfg, self.dropout_stream = sublayer_parts(layer, which,
                                                                      self.streams_field, hc)
        config = layer.config
        self.layer = layer
        self.hc = KernelsOver(module, config.hidden_size, self.cfg.num_streams,
                              config.mhc_sinkhorn_iterations, kernels="auto",
                              h_res_transposed=self.h_res_transposed, arithmetic=self.arithmetic)
        self.norm = NormParams(norm, config)
        self.fn: Callable[[Tensor], Tensor] | None = None  # bound per forward (the layer's bind)

    def take_output(self, out: Tensor, bias: Tensor | None) -> Tensor:
        """F's result as the fused post takes it: the bias inside the output."""
        return out if bias is None else out + bias

    @property
    def dropout_p(self) -> float:
        return self.layer.hidden_dropout if self.layer.training else 0.0


def uses_fused_mhc(config, fused_mhc: bool | None) -> bool:
    """``fused_mhc`` where given, else the config's ``use_fused_mhc`` (Megatron-LM dev's field;
    main has none: off)."""
    return bool(getattr(config, "use_fused_mhc", False) if fused_mhc is None else fused_mhc)
