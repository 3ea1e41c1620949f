"""megatron-core layers with mHC around attention and MLP, and mhc_cg's block recompute.

* ``MegatronMHCTransformerLayer`` (a ``TransformerLayer``): takes and returns streams ``[s, b, n*C]``.
  Each of its two sublayers runs ``x' = H_res x + H_post^T F(norm(H_pre x))`` with
  ``mhc_cg.ops.hyper_connection.HyperConnection``; F is megatron-core's own attention or MLP (output
  plus bias), ``norm`` its ``input_layernorm`` / ``pre_mlp_layernorm``; dropout follows
  ``config.mhc_dropout_impl``.
* ``MHCTransformerBlock`` (a ``TransformerBlock``): expands ``[s, b, C]`` to n streams on the first
  pipeline stage, contracts them (mean) before the final layernorm on the last. With
  ``config.mhc_recompute_layer_num = L_r`` it runs groups of L_r layers under one
  ``mhc_cg.recompute.block_recompute.BlockRecomputeManager`` (``run_recompute_blocks``, the same code as mhc_cg's
  own model, over the step adapters of ``megatron_integration.layers.steps``): every mHC step (mappings, aggregate, norm, H_post,
  H_res, bias-dropout-add) is a ``CheckpointWithoutOutput`` whose output is freed after the block;
  the block input and each F output stay; one hook on the block's last output recomputes the rest.
  Blocks restart at each block (model chunk), so they never cross a pipeline stage.
* ``get_mhc_layer_spec``: megatron-core's local GPT layer spec with ``MegatronMHCTransformerLayer``.
  ``cpu_attention=True`` swaps the core attention for ``SDPACoreAttention``
  (``megatron_integration.layers.sdpa_attention``): megatron-core 0.16's ``DotProductAttention`` cannot
  run without CUDA.
* Under megatron's TE graph helper (``cuda_graph_impl: transformer_engine``) the layer's graph is
  its attention sublayer on mhc_cg's static runtime (``GraphedSublayerMixin``,
  ``megatron_integration.layers.graphed_sublayer``; the helper: ``megatron_integration.capture.te_graph_helper``).

Pipeline parallelism across processes would also need megatron-core's p2p tensor shape to be
``[s, b, n*C]`` (it assumes ``hidden_size``); that is not wired here.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor

from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                   get_gpt_layer_with_transformer_engine_spec)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

from mhc_cg.ops.hyper_connection import HyperConnection, contract_streams, expand_streams
from mhc_cg.model import sublayer_forward
from mhc_cg.recompute.block_recompute import run_recompute_blocks
from mhc_cg.graphs.te import te_installed

from megatron_integration.layers.graphed_sublayer import GraphedSublayerMixin
from megatron_integration.layers.sdpa_attention import SDPACoreAttention
from megatron_integration.config.transformer_config import MHCTransformerConfig
from megatron_integration.layers.steps import LayerSteps


def get_mhc_layer_spec(*, cpu_attention: bool = False,
                       normalization: str = "RMSNorm") -> ModuleSpec:
    """megatron-core's GPT layer spec, its layer replaced by ``MegatronMHCTransformerLayer``: TE's
    (``get_gpt_layer_with_transformer_engine_spec``) where TransformerEngine is installed and the
    attention is not the CPU's, else the local one."""
    te = te_installed() and not cpu_attention
    spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec() if te
                         else get_gpt_layer_local_spec(normalization=normalization))
    spec.module = MegatronMHCTransformerLayer
    if cpu_attention:  # and the norms: megatron's local norm refuses sequence parallelism
        from megatron_integration.layers.cpu_norm import SequenceParallelRMSNorm

        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        if normalization == "RMSNorm":
            spec.submodules.input_layernorm = SequenceParallelRMSNorm
            spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return spec


class MegatronMHCTransformerLayer(GraphedSublayerMixin, TransformerLayer):
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
            if config.sequence_parallel:
                # each tensor-parallel rank sees its own slice of the sequence: megatron sums
                # these gradients over the ranks (finalize_model_grads), as for dev's mHC module
                for p in (*self.attention_hc.parameters(), *self.mlp_hc.parameters()):
                    p.sequence_parallel = True

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


_TP_SEED_STRIDE = 0x9E3779B1  # an odd constant far from small offsets: distinct ranks' seeds


class MHCTransformerBlock(TransformerBlock):
    """A ``TransformerBlock`` of ``MegatronMHCTransformerLayer``s; see the module docstring."""

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
        config = self.config
        if not getattr(config, "enable_hyper_connections", False):
            return super().forward(hidden_states, attention_mask, **kwargs)
        hidden_states = self.streams_in(hidden_states)
        seed = self.draw_dropout_seed(hidden_states)
        if config.mhc_recompute and self.training and torch.is_grad_enabled():
            hidden_states = self._run_recompute_blocks(hidden_states, attention_mask, seed, kwargs)
        else:
            for layer in self.layers:
                hidden_states, _ = layer(hidden_states, attention_mask=attention_mask,
                                         mhc_dropout_seed=seed, **kwargs)
        return self.streams_out(hidden_states)

    def draw_dropout_seed(self, like: Tensor) -> Tensor | None:
        """A training forward's seed for ``counter`` dropout (``None`` when dropout needs none)."""
        config = self.config
        if config.mhc_dropout_impl == "counter" and self.training and config.hidden_dropout > 0:
            seed = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64)
            if config.sequence_parallel:
                # the mask hashes (seed, element index) and each tensor-parallel rank indexes its
                # own slice of the sequence from 0: a seed per rank, or every slice drops alike
                from megatron.core import parallel_state

                rank = parallel_state.get_tensor_model_parallel_rank()
                seed = (seed + rank * _TP_SEED_STRIDE) % (2 ** 31 - 1)
            return seed.to(like.device)
        return None

    def streams_in(self, hidden_states: Tensor) -> Tensor:
        """``[s, b, C] -> [s, b, n*C]`` on the first pipeline stage; later stages get the streams
        the schedule received (``set_input_tensor``)."""
        if not self.pre_process:
            return self.input_tensor
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
