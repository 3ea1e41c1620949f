"""megatron-core layers with mHC around attention and MLP, and mhc_cg's block recompute.

* ``MegatronMHCTransformerLayer`` (a ``TransformerLayer``): takes and returns streams ``[s, b, n*C]``.
  Each of its two sublayers runs ``x' = H_res x + H_post^T F(norm(H_pre x))`` with
  ``mhc_cg.ops.hyper_connection.HyperConnection``; F is megatron-core's own attention or MLP (output
  plus bias), ``norm`` its ``input_layernorm`` / ``pre_mlp_layernorm``; dropout follows
  ``config.mhc_dropout_impl``.
* ``MHCTransformerBlock`` (a ``TransformerBlock``): expands ``[s, b, C]`` to n streams on the first
  pipeline stage, contracts them (mean) before the final layernorm on the last. With
  ``config.mhc_recompute_layer_num = L_r`` it runs groups of L_r layers under one
  ``mhc_cg.runtime.recompute.eager.BlockRecomputeManager`` (``run_recompute_blocks``, the same code as mhc_cg's
  own model, over the step adapters of ``megatron_integration.steps``): every mHC step (mappings, aggregate, norm, H_post,
  H_res, bias-dropout-add) is a ``CheckpointWithoutOutput`` whose output is freed after the block;
  the block input and each F output stay; one hook on the block's last output recomputes the rest.
  Blocks restart at each block (model chunk), so they never cross a pipeline stage.
* ``get_mhc_layer_spec``: megatron-core's local GPT layer spec with ``MegatronMHCTransformerLayer``.
  ``cpu_attention=True`` swaps the core attention for ``SDPACoreAttention``: megatron-core 0.16's
  ``DotProductAttention.forward`` takes its score buffer from
  ``parallel_state.get_global_memory_buffer().get_tensor(...)``, which allocates on
  ``torch.cuda.current_device()`` and so cannot run without CUDA.

Pipeline parallelism across processes would also need megatron-core's p2p tensor shape to be
``[s, b, n*C]`` (it assumes ``hidden_size``); that is not wired here.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

from mhc_cg.ops.hyper_connection import HyperConnection, contract_streams, expand_streams
from mhc_cg.model import sublayer_forward
from mhc_cg.runtime.recompute.eager import run_recompute_blocks

from .transformer_config import MHCTransformerConfig
from .steps import LayerSteps


class SDPACoreAttention(MegatronModule):
    """A core attention with ``DotProductAttention``'s interface on ``F.scaled_dot_product_attention``.

    ``query/key/value [s, b, heads, head_dim] -> [s, b, heads * head_dim]``; causal when no mask
    is given and the mask type is causal; ``attention_mask`` is megatron's boolean "masked out".
    Runs on any device (no tensor parallelism, no packed sequences).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None,
                packed_seq_params=None) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: no attention bias or packed sequences")
        if key.shape[2] != query.shape[2]:  # grouped-query attention
            repeat = query.shape[2] // key.shape[2]
            key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask_type = attn_mask_type or self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
            dropout_p=self.dropout_p if self.training else 0.0, is_causal=causal,
            scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def get_mhc_layer_spec(*, cpu_attention: bool = False, normalization: str = "RMSNorm") -> ModuleSpec:
    """megatron-core's local GPT layer spec, its layer replaced by ``MegatronMHCTransformerLayer``."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    spec.module = MegatronMHCTransformerLayer
    if cpu_attention:
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


class MegatronMHCTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` on n residual streams; see the module docstring."""

    def __init__(self, config: MHCTransformerConfig, submodules, layer_number: int = 1,
                 hidden_dropout: float | None = None, pg_collection=None, vp_stage: int | None = None):
        super().__init__(config, submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         vp_stage=vp_stage)
        self.mhc = bool(getattr(config, "enable_hyper_connections", False))
        if self.mhc:
            def hyper_connection() -> HyperConnection:
                return HyperConnection(config.hidden_size, config.num_residual_streams,
                                       config.mhc_sinkhorn_iterations, config.mhc_init_gating_factor,
                                       kernels=getattr(config, "mhc_kernels", "auto"))

            self.attention_hc = hyper_connection()
            self.mlp_hc = hyper_connection()

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args,
                mhc_dropout_seed: Tensor | None = None, **kwargs):
        """``[s, b, n*C] -> ([s, b, n*C], context)``; megatron-core's layer when mHC is off."""
        if not self.mhc:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        if args:
            raise TypeError("MegatronMHCTransformerLayer: pass attention arguments by keyword")
        steps = LayerSteps(self, attention_mask, **kwargs)
        x = sublayer_forward(steps.attention, hidden_states, mhc_dropout_seed)
        return sublayer_forward(steps.mlp, x, mhc_dropout_seed), None

    def sublayer_fns(self, attention_mask: Tensor | None,
                     kwargs: dict) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
        """F of each sublayer for one forward: megatron's attention and MLP, bias added."""
        kwargs = dict(kwargs)
        kwargs.pop("dynamic_inference_decode_only", None)
        padding_mask = kwargs.pop("padding_mask", None)
        kwargs.pop("context", None), kwargs.pop("context_mask", None)  # no cross attention in GPT

        def attention(normed: Tensor) -> Tensor:
            out, bias = self.self_attention(normed, attention_mask=attention_mask, **kwargs)
            return out if bias is None else out + bias

        def mlp(normed: Tensor) -> Tensor:
            out, bias = self.mlp(normed, padding_mask=padding_mask)
            return out if bias is None else out + bias

        return attention, mlp

    def mhc_post_bda(self, y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None,
                     stream: int) -> Tensor:
        """``mixed + dropout(h_post * y)`` of sublayer ``stream`` (0 attention, 1 MLP), fused."""
        hc = self.attention_hc if stream == 0 else self.mlp_hc
        return hc.post_bda(y, h_post, mixed, seed, self.hidden_dropout if self.training else 0.0,
                           2 * self.layer_number + stream, self.config.mhc_dropout_impl)


class MHCTransformerBlock(TransformerBlock):
    """A ``TransformerBlock`` of ``MegatronMHCTransformerLayer``s; see the module docstring."""

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
        config = self.config
        if not getattr(config, "enable_hyper_connections", False):
            return super().forward(hidden_states, attention_mask, **kwargs)
        hidden_states = self.streams_in(hidden_states)
        seed = None
        if config.mhc_dropout_impl == "counter" and self.training and config.hidden_dropout > 0:
            seed = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64).to(hidden_states.device)
        if config.mhc_recompute and self.training and torch.is_grad_enabled():
            hidden_states = self._run_recompute_blocks(hidden_states, attention_mask, seed, kwargs)
        else:
            for layer in self.layers:
                hidden_states, _ = layer(hidden_states, attention_mask=attention_mask,
                                         mhc_dropout_seed=seed, **kwargs)
        return self.streams_out(hidden_states)

    def streams_in(self, hidden_states: Tensor) -> Tensor:
        """``[s, b, C] -> [s, b, n*C]`` on the first pipeline stage (later stages get streams)."""
        if not self.pre_process:
            return hidden_states
        return expand_streams(hidden_states, self.config.num_residual_streams)

    def streams_out(self, x: Tensor) -> Tensor:
        """Contract the streams and apply the final norm on the last pipeline stage."""
        if not self.post_process:
            return x
        x = contract_streams(x, self.config.num_residual_streams)
        final_norm = getattr(self, "final_layernorm", None)
        return x if final_norm is None else final_norm(x)

    def _run_recompute_blocks(self, x: Tensor, attention_mask, seed, kwargs) -> Tensor:
        """Groups of L_r layers, each under one manager; ``self.recompute_managers`` holds them."""
        self.recompute_managers = []
        steps = [LayerSteps(layer, attention_mask, **kwargs) for layer in self.layers]
        return run_recompute_blocks(steps, x, seed, self.config.mhc_recompute_layer_num,
                                    self.recompute_managers)
