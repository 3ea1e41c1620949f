"""Megatron-LM ``dev``'s own mHC layer (its ``HyperConnectionTransformerLayer``) on mhc_cg's runtimes.

``dev`` keeps ``main``'s class and module names but not their arithmetic, so the step adapters
of :mod:`megatron_integration.layers.main_layer` are subclassed here where ``dev`` differs:

* the three readers of a sublayer's input (mappings, aggregate, H_res) take three views of it
  from ``dev``'s ``BroadcastTensorFused``, whose backward sums their gradients in one fixed
  order (``_fused_add_3_op``), whatever order autograd delivers them in;
* H_res is applied transposed (``H_res^T x``, a ``bmm`` of the transposed matrix) and H_post with
  F's bias as ``dev``'s ``native_h_post_bda`` adds them: ``H_post y + H_post bias + mixed``;
* the MLP's input is cast back to ``params_dtype`` before its norm (dense layers), as ``dev``'s
  ``_forward_mlp`` does;
* the stream boundaries are ``dev``'s own block methods (``preprocess_for_layer_schedule``:
  the pipeline's received tensor and the n-fold expand; ``postprocess_for_layer_schedule``: its
  learned output contraction and the final norm).

Every step calls ``dev``'s module functions, so the static runtime's forward, recompute and the
reference run compute the same bits. Dropout: ``dev``'s draws from torch's stateful generator,
which no recompute can rewind, so ``hidden_dropout > 0`` needs the opt-in of
:mod:`megatron_integration.layers.counter_dropout` (the same counter mask in every run). Everything from
``megatron.core`` is imported lazily: ``dev``'s megatron.core must be first on the path.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor

from mhc_cg.graphs.te import te_installed

from megatron_integration.layers.fused_sublayer import MegatronFusedSublayer
from megatron_integration.layers.main_layer import (MainLayerSteps, MainSublayerSteps,
                                                    graphed_layer_class)

# keywords dev's block takes that its attention does not
_BLOCK_ONLY_KWARGS = ("extract_layer_indices", "dynamic_inference_decode_only",
                      "inference_params")


def is_dev_config(config) -> bool:
    """``dev``'s mHC config (``enable_hyper_connections`` + ``num_residual_streams``) on a
    ``HyperConnectionTransformerLayer``; ``main`` spells it ``mhc_num_residual_streams``."""
    return hasattr(config, "num_residual_streams") and not hasattr(config, "mhc_num_residual_streams")


def dev_mhc_layer_spec(*, cpu: bool = False, graphed: bool = False):
    """``dev``'s own GPT layer spec with mHC (``enable_hyper_connection=True``), dense: TE's
    (``get_gpt_layer_with_transformer_engine_spec``) where TransformerEngine is installed, else
    the local one with RMSNorm; see :func:`_on_runtime` for ``cpu`` and ``graphed``."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    base = (get_gpt_layer_with_transformer_engine_spec(enable_hyper_connection=True)
            if te_installed() else
            get_gpt_layer_local_spec(normalization="RMSNorm", enable_hyper_connection=True))
    return _on_runtime(base, cpu, graphed)


def dev_mhc_block_spec(config, vp_stage: int | None, *, cpu: bool = False, graphed: bool = False):
    """``dev``'s own decoder spec of one model chunk (``get_gpt_decoder_block_spec``, on TE's
    modules where TransformerEngine is installed): dense and MoE layers as
    ``config.moe_layer_freq`` places them, each adapted by :func:`_on_runtime`;
    on the CPU the final norm is ``SequenceParallelRMSNorm``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te_installed(),
                                       normalization="RMSNorm", vp_stage=vp_stage)
    block.layer_specs = [_on_runtime(spec, cpu, graphed) for spec in block.layer_specs]
    if cpu:
        from megatron_integration.layers.cpu_norm import SequenceParallelRMSNorm

        block.layer_norm = SequenceParallelRMSNorm
    return block


def _on_runtime(spec, cpu: bool, graphed: bool):
    """A copy of a ``dev`` mHC layer spec. ``cpu``: ``SDPACoreAttention`` as the core attention
    and ``SequenceParallelRMSNorm`` as the norms (megatron's local ones refuse sequence
    parallelism). ``graphed``: the layer class with ``GraphedSublayerMixin`` (same parameters)."""
    spec = copy.deepcopy(spec)
    if graphed:
        spec.module = graphed_layer_class(spec.module)
    if cpu:
        from megatron_integration.layers.cpu_norm import SequenceParallelRMSNorm
        from megatron_integration.layers.sdpa_attention import SDPACoreAttention

        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        spec.submodules.input_layernorm = SequenceParallelRMSNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return spec


class DevSublayerSteps(MainSublayerSteps):
    """The attention or MLP sublayer of ``dev``'s ``HyperConnectionTransformerLayer``."""

    streams_field = "num_residual_streams"
    casts_mlp_input = True  # dev's GPT layer casts a dense MLP's input to params_dtype first

    def __init__(self, layer, which: str, hc=None):
        super().__init__(layer, which, hc)
        if which != "attention" and not layer.is_moe_layer and self.casts_mlp_input:
            self.norm = _in_dtype(self.norm, layer.config.params_dtype)
        self._views: tuple[Tensor, Tensor, Tensor] | None = None  # (x, aggregate's, H_res's)

    def mappings(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        from megatron.core.transformer.hyper_connection import BroadcastTensorFused

        for_mappings, for_aggregate, for_residual = BroadcastTensorFused.apply(
            x, self.hc._fused_add_3_op)
        self._views = (x, for_aggregate, for_residual)
        return self.hc.compute_mappings(for_mappings)

    def _view(self, x: Tensor, which: int) -> Tensor:
        if self._views is None or self._views[0] is not x:
            raise RuntimeError("DevSublayerSteps: aggregate/h_res_step called on another input "
                               "than the last mappings(); call mappings(x) first")
        return self._views[which]

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        return self.hc.aggregate(self._view(x, 1), h_pre)

    def h_res_step(self, h_res: Tensor, x: Tensor) -> Tensor:
        """``H_res^T x`` as ``dev``'s ``native_h_post_bda`` computes it, ``[s, b, n, C]``."""
        residual = self._view(x, 2)
        self._views = None  # the last reader of x
        s, b, _ = residual.shape
        n, c = self.cfg.num_streams, self.cfg.hidden_size
        mixed = torch.bmm(h_res.view(s * b, n, n).transpose(1, 2), residual.view(s * b, n, c))
        return mixed.view(s, b, n, c)

    def post_bda(self, y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None) -> Tensor:
        """``H_post y (+ H_post bias) + mixed``, ``dev``'s dropout-free post, op for op; with
        counter dropout (``use_counter_dropout``) ``mixed + dropout(H_post y + H_post bias)``,
        dev's dropout path with the counter mask."""
        s, b, n, c = mixed.shape
        p = self.layer.hidden_dropout if self.layer.training else 0.0
        if p == 0.0:  # native_h_post_bda's terms
            out = h_post.unsqueeze(-1) * y.unsqueeze(2)
            if self.bias is not None:
                out = out + h_post.unsqueeze(-1) * self.bias.view(1, 1, 1, c)
            return (out + mixed).view(s, b, n * c)
        if self.cfg.dropout_impl != "counter":
            raise RuntimeError("DevSublayerSteps: hidden_dropout > 0 with torch's stateful dropout "
                               "cannot be recomputed; call use_counter_dropout on the decoder")
        # main's counter path: the same terms as dev's dropout path
        return super().post_bda(y, h_post, mixed.view(s, b, n * c), seed)


def _in_dtype(norm, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    def cast_then_norm(h: Tensor) -> Tensor:
        return norm(h if h.dtype == dtype else h.to(dtype))
    return cast_then_norm


class DevLayerSteps(MainLayerSteps):
    """Both sublayers of ``dev``'s layer; ``bind`` drops the block-only keywords first."""

    sublayer_type = DevSublayerSteps

    def bind(self, attention_mask: Tensor | None = None, **kwargs) -> "DevLayerSteps":
        for name in _BLOCK_ONLY_KWARGS:
            kwargs.pop(name, None)
        return super().bind(attention_mask, **kwargs)


class DevFusedSublayer(MegatronFusedSublayer):
    """A sublayer of dev's layer on mhc_cg's fused kernels, in dev's (DeepSeek-V4's) arithmetic:
    ``h_pre = sigmoid + 1e-6``, dev's Sinkhorn, H_res applied transposed."""

    streams_field = "num_residual_streams"
    arithmetic = "dev"
    h_res_transposed = True


class DevFusedLayerSteps(DevLayerSteps):
    """Both sublayers of dev's layer on mhc_cg's fused kernels (dev's ``use_fused_mhc``)."""

    sublayer_type = DevFusedSublayer


def dev_layer_steps(fused_mhc: bool) -> type[DevLayerSteps]:
    """The step adapters of dev's layer: mhc_cg's fused kernels, or dev's own ops op for op."""
    return DevFusedLayerSteps if fused_mhc else DevLayerSteps


def layer_steps_of(config, fused_mhc: bool) -> type[MainLayerSteps]:
    """The step adapters of a ``HyperConnectionTransformerLayer`` built under ``config``:
    dev's (:func:`dev_layer_steps`) or main's (``main_layer_steps``)."""
    from megatron_integration.layers.main_layer import main_layer_steps

    return dev_layer_steps(fused_mhc) if is_dev_config(config) else main_layer_steps(fused_mhc)
