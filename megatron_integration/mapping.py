"""From mhc_cg's YAML ``RunConfig`` to megatron-core's ``TransformerConfig`` (``MHCTransformerConfig``).

==============================  =============================================================
RunConfig                       MHCTransformerConfig
==============================  =============================================================
model.num_layers/hidden_size    num_layers / hidden_size
model.num_heads                 num_attention_heads
model.ffn_hidden_size           ffn_hidden_size
model.hidden_dropout            hidden_dropout (attention_dropout 0: mhc_cg's attention has none)
model.dropout_impl              mhc_dropout_impl
model.kernels                   mhc_kernels
model.init_std                  init_method_std
model.num_streams               num_residual_streams; enable_hyper_connections = n > 1
model.sinkhorn_iterations       mhc_sinkhorn_iterations
model.init_gating_factor        mhc_init_gating_factor
model.recompute (block)         mhc_recompute_layer_num = L_r (None when recompute is none)
model.num_experts/moe_top_k     num_moe_experts / moe_router_topk
model.moe_ffn_hidden_size       moe_ffn_hidden_size
train.dtype                     params_dtype, pipeline_dtype, bf16 / fp16
train.device == cpu             use_cpu_initialization
parallel.pp_size / vpp_size     pipeline_model_parallel_size / virtual_pipeline_model_parallel_size
parallel.microbatch_group_size  microbatch_group_size_per_vp_stage
graph.cuda_graph_scope          cuda_graph_scope (``mhc_recompute`` -> mhc_recompute_graph)
graph.backend                   cuda_graph_impl: ``te`` -> transformer_engine (megatron-core's
                                TECudaGraphHelper captures the layers); cuda/tape/auto -> none
                                (mhc_cg's own graphed callables capture them)
==============================  =============================================================

Normalisation is RMSNorm (as mhc_cg's model); fusions that need CUDA extensions are off.
"""

from __future__ import annotations

from typing import Any


from mhc_cg.config import RunConfig, check
from mhc_cg.core.dtypes import TORCH_DTYPES

from .transformer_config import MHCTransformerConfig

def transformer_config_kwargs(run_cfg: RunConfig) -> dict[str, Any]:
    """The keyword arguments of ``MHCTransformerConfig`` that ``run_cfg`` implies."""
    check(run_cfg)
    m, t, p = run_cfg.model, run_cfg.train, run_cfg.parallel
    scopes = run_cfg.graph.scopes
    kwargs: dict[str, Any] = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        normalization="RMSNorm",
        enable_hyper_connections=m.num_streams > 1,
        num_residual_streams=m.num_streams,
        mhc_sinkhorn_iterations=m.sinkhorn_iterations,
        mhc_init_gating_factor=m.init_gating_factor,
        mhc_recompute_layer_num=m.resolved_recompute_layers if m.recompute == "block" else None,
        mhc_dropout_impl=m.dropout_impl,
        mhc_kernels=m.kernels,
        params_dtype=TORCH_DTYPES[t.dtype],
        pipeline_dtype=TORCH_DTYPES[t.dtype],
        bf16=t.dtype == "bf16",
        fp16=t.dtype == "fp16",
        use_cpu_initialization=t.device == "cpu",
        pipeline_model_parallel_size=p.pp_size,
        virtual_pipeline_model_parallel_size=p.vpp_size if p.vpp_size > 1 else None,
        microbatch_group_size_per_vp_stage=p.microbatch_group_size,
        cuda_graph_scope=scopes,
        cuda_graph_impl="transformer_engine" if scopes and run_cfg.graph.backend == "te" else "none",
        # Fused kernels that need CUDA extensions; mhc_cg's bda is its own.
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )
    if m.is_moe:
        kwargs.update(num_moe_experts=m.num_experts, moe_router_topk=m.moe_top_k,
                      moe_ffn_hidden_size=m.moe_ffn_hidden_size)
    return kwargs


def to_transformer_config(run_cfg: RunConfig, **overrides: Any) -> MHCTransformerConfig:
    """``run_cfg`` (validated first) as megatron-core's config; ``overrides`` win."""
    return MHCTransformerConfig(**{**transformer_config_kwargs(run_cfg), **overrides})
