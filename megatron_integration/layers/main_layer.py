"""Megatron-LM ``main``'s own mHC layer (``HyperConnectionTransformerLayer``) on mhc_cg's runtimes.

Megatron-LM ``main`` ships mHC as ``HyperConnectionModule`` (mappings, aggregate, H_res, H_post,
its fused H_res/H_post/bias-dropout-add) inside ``HyperConnectionTransformerLayer``, with its own
``recompute_modules: [mhc]`` recompute. No megatron-core release has it yet, so everything from
``megatron.core`` is imported lazily: this module imports with any megatron-core (or none), and
its functions need ``main``'s ``megatron.core`` first on the path when called.

* ``main_mhc_layer_spec``: ``main``'s local GPT layer spec with its mHC layer and modules.
* ``MainLayerSteps``: one such layer as ``mhc_cg``'s named sublayer steps (``mappings``,
  ``aggregate``, ``norm``, ``fn``, ``h_res_step``, ``post_bda``,
  ``cfg``), each step ``main``'s own code: every runtime of ``mhc_cg`` (plain sublayer, eager
  block recompute, static buffers and recompute graphs) then runs ``main``'s modules unchanged.
* ``MainBlock``: ``main``'s ``TransformerBlock`` of those layers, forward through ``mhc_cg``'s
  eager block recompute (``forward_block_recompute``) or its static-buffer runtime
  (``megatron_integration.capture.static_block.StaticMainBlock``).

The steps keep ``main``'s arithmetic op for op, so gradients equal ``main``'s no-recompute path
bit for bit: F returns ``(output, bias)`` with the bias not added (``skip_bias_add``), and
``main`` expands output and bias by H_post separately and adds them in its bias-dropout-add.
``h_post_step`` does the same two expansions and that one add (the bias is F's, remembered
from the forward: a parameter, never recomputed); ``post_bda`` then applies ``main``'s
``residual + dropout(x)``. The order of H_res relative to H_post differs between runtimes, which
is harmless: they share no input, and H_res stays the last consumer of the residual created.
"""

from __future__ import annotations

import copy
from typing import Callable

from torch import Tensor

from mhc_cg.model import HyperConnectionSteps
from mhc_cg.ops.dropout import dropout
from mhc_cg.recompute.block_recompute import BlockRecomputeManager, run_recompute_blocks

from mhc_cg.graphs.te import te_installed

from megatron_integration.layers.fused_sublayer import MegatronFusedSublayer, sublayer_parts
from megatron_integration.layers.graphed_sublayer import GraphedSublayerMixin
from megatron_integration.layers.steps import LayerSteps

MAIN_NEEDED = ("megatron_integration.layers.main_layer: needs Megatron-LM main's megatron.core "
               "(megatron.core.transformer.hyper_connection); the installed megatron-core has no "
               "mHC: put a main checkout first on PYTHONPATH")


def _main_modules():
    try:
        from megatron.core.transformer.hyper_connection import HyperConnectionModule
        from megatron.core.transformer.transformer_layer import HyperConnectionTransformerLayer
    except ImportError as err:
        raise ImportError(MAIN_NEEDED) from err
    return HyperConnectionModule, HyperConnectionTransformerLayer


def main_mhc_layer_spec(normalization: str = "RMSNorm", *, cpu_attention: bool = False,
                        graphed: bool = False):
    """``main``'s GPT layer spec with ``HyperConnectionTransformerLayer`` and a
    ``HyperConnectionModule`` around attention and MLP (``main`` builds no such spec in core):
    on TE's spec (``get_gpt_layer_with_transformer_engine_spec``) where TransformerEngine is
    installed, else the local one.

    ``cpu_attention``: the core attention is ``SDPACoreAttention`` (``megatron_integration.
    sdpa_attention``). ``graphed``: the layer is ``main``'s with ``GraphedSublayerMixin``, for
    megatron's TE layer graphs on mhc_cg's static runtime (``graphed_sublayer``); same parameters.
    """
    hyper_connection, layer = _main_modules()
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec() if te_installed()
                         else get_gpt_layer_local_spec(normalization=normalization))
    spec.module = graphed_layer_class(layer) if graphed else layer
    spec.submodules.self_attention_hyper_connection = hyper_connection
    spec.submodules.mlp_hyper_connection = hyper_connection
    if cpu_attention:
        from megatron_integration.layers.sdpa_attention import SDPACoreAttention

        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


_GRAPHED_LAYERS: dict[type, type] = {}


def graphed_layer_class(layer: type) -> type:
    """``layer`` (a megatron ``HyperConnectionTransformerLayer``, main's or dev's) with
    ``GraphedSublayerMixin`` before it, made once per class."""
    if layer not in _GRAPHED_LAYERS:
        _GRAPHED_LAYERS[layer] = type(f"Graphed{layer.__name__}", (GraphedSublayerMixin, layer), {})
    return _GRAPHED_LAYERS[layer]


class MainSublayerSteps(HyperConnectionSteps):
    """The attention or MLP sublayer of a ``HyperConnectionTransformerLayer`` as named steps."""

    streams_field = "mhc_num_residual_streams"  # the config's n (dev: num_residual_streams)

    def __init__(self, layer, which: str, hc=None):
        self.layer = layer
        self.hc, self.norm, self.cfg, self.stream = sublayer_parts(layer, which, self.streams_field,
                                                                   hc)
        self.fn: Callable[[Tensor], Tensor] | None = None  # bound per forward (MainLayerSteps.bind)
        self.bias: Tensor | None = None  # F's skipped bias, set by fn

    def take_output(self, out: Tensor, bias: Tensor | None) -> Tensor:
        """F's result as the steps take it: the output, the bias kept for ``h_post_step``."""
        self.bias = bias
        return out

    def h_post_step(self, y: Tensor, h_post: Tensor) -> Tensor:
        """``H_post^T y (+ H_post^T bias)``: the input of main's bias-dropout-add, ``x + bias``."""
        out = self.hc._apply_h_post(y, h_post)
        if self.bias is None:
            return out
        return out + self.hc._apply_h_post(self.bias, h_post)

    def post_bda(self, y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None) -> Tensor:
        """``main``'s own bias-dropout-add of ``H_post^T (y + bias)`` onto ``mixed`` (``seed``
        unused: main's dropout draws from torch's generator); with counter dropout
        (``use_counter_dropout``) the same terms, ``mixed + dropout(...)``, the mask drawn from
        ``seed``."""
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

        p = self.layer.hidden_dropout if self.layer.training else 0.0
        if p > 0.0 and self.cfg.dropout_impl == "counter":
            return mixed + dropout(self.h_post_step(y, h_post), p, True, impl="counter",
                                   seed=seed, stream=self.stream)
        bda = get_bias_dropout_add(self.layer.training, self.layer.config.bias_dropout_fusion)
        return bda((self.h_post_step(y, h_post), None), mixed, self.layer.hidden_dropout)


class MainLayerSteps(LayerSteps):
    """Both sublayers of a ``HyperConnectionTransformerLayer``; ``bind`` sets F's arguments."""

    sublayer_type = MainSublayerSteps

    def bind(self, attention_mask: Tensor | None = None, **kwargs) -> "MainLayerSteps":
        """F of each sublayer for one forward: ``main``'s self-attention and MLP.

        ``kwargs`` are the layer's attention keywords (``rotary_pos_emb``, ``packed_seq_params``,
        ...); ``padding_mask`` goes to the MLP. Cross attention is not part of ``main``'s mHC layer.
        """
        kwargs = dict(kwargs)
        padding_mask = kwargs.pop("padding_mask", None)
        input_ids = kwargs.pop("input_ids", None)
        for unused in ("context", "context_mask"):
            if kwargs.pop(unused, None) is not None:
                raise ValueError(f"MainLayerSteps: {unused} given, but HyperConnectionTransformerLayer "
                                 f"has no cross attention; drop {unused}")
        layer, attention, mlp = self.layer, self.attention, self.mlp

        def attention_fn(normed: Tensor) -> Tensor:
            return attention.take_output(*layer.self_attention(normed, attention_mask=attention_mask,
                                                               **kwargs))

        mlp_kwargs = {"padding_mask": padding_mask}
        if input_ids is not None and getattr(layer, "is_moe_layer", False):
            mlp_kwargs["input_ids"] = input_ids  # hash-routed MoE routes by token id

        def mlp_fn(normed: Tensor) -> Tensor:
            return mlp.take_output(*layer.mlp(normed, **mlp_kwargs))

        self.mlp_kwargs = mlp_kwargs  # the MLP's keywords beside its input
        for sub, fn in ((attention, attention_fn), (mlp, mlp_fn)):
            if sub is not None:  # a hybrid stack's layer holds one of the two
                sub.fn = fn
        return self


class MainFusedLayerSteps(MainLayerSteps):
    """Both sublayers of main's layer on mhc_cg's fused kernels (``use_fused_mhc``)."""

    sublayer_type = MegatronFusedSublayer


def main_layer_steps(fused_mhc: bool) -> type[MainLayerSteps]:
    """The step adapters of main's layer: mhc_cg's fused kernels, or main's own ops op for op."""
    return MainFusedLayerSteps if fused_mhc else MainLayerSteps


class MainBlock:
    """``main``'s ``TransformerBlock`` (mHC on) with its layers on ``mhc_cg``'s block recompute.

    ``streams_in``/``streams_out`` are ``main``'s own block boundaries: expand to n streams on the
    first pipeline stage, contract (mean) and the final norm on the last.
    """

    def __init__(self, block, fused_mhc: bool = False):
        if not getattr(block.config, "enable_mhc_connections", False):
            raise ValueError("MainBlock: the block's config has enable_mhc_connections off; "
                             "set enable_mhc_connections=True")
        self.block = block
        self.config = block.config
        self.layers = block.layers
        self.managers: list[BlockRecomputeManager] = []
        self.steps_type = main_layer_steps(fused_mhc)
        self.steps: list[MainLayerSteps] = []

    def streams_in(self, hidden_states: Tensor) -> Tensor:
        from megatron.core.utils import make_viewless_tensor

        hyper_connection, _ = _main_modules()
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not self.block.pre_process:
            return hidden_states
        return hyper_connection.input_expand(hidden_states, self.config.mhc_num_residual_streams)

    def streams_out(self, x: Tensor) -> Tensor:
        hyper_connection, _ = _main_modules()
        if self.block.has_final_layernorm_in_this_stage():
            x = hyper_connection.output_contract(x, self.config.mhc_num_residual_streams)
        final_norm = self.block.final_layernorm
        return x if final_norm is None else final_norm(x)

    def forward_block_recompute(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                                block_size: int | None = None, **kwargs) -> Tensor:
        """The block's forward with ``mhc_cg``'s eager block recompute: blocks of ``block_size``
        layers (default ``config.mhc_recompute_layer_num``, else all), one manager each
        (``self.managers``); every mHC step is checkpointed and freed, F's outputs are kept."""
        self.steps = [self.steps_type(layer, attention_mask, **kwargs) for layer in self.layers]
        size = block_size or self.config.mhc_recompute_layer_num or len(self.steps)
        self.managers = []
        x = run_recompute_blocks(self.steps, self.streams_in(hidden_states), None, size,
                                 self.managers)
        return self.streams_out(x)
