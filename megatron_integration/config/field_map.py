"""mhc_cg's YAML ``RunConfig`` as megatron's ``TransformerConfig``: one field map, two spellings.

``transformer_config_kwargs`` / ``to_transformer_config``: mhc_cg's own layer on megatron-core
(``MHCTransformerConfig``, the dev branch's field names). ``megatron_config_kwargs``:
Megatron-LM main's or dev's own ``HyperConnectionTransformerLayer`` (the branch's
``TransformerConfig`` and names, plain values that cross a process boundary as JSON). Both take the shared fields from
``_shared_kwargs``.

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
model.moe_layer_freq            moe_layer_freq
parallel.ep_size                expert_model_parallel_size
train.dtype                     params_dtype, pipeline_dtype, bf16 / fp16
train.device == cpu             use_cpu_initialization
parallel.pp_size / vpp_size     pipeline_model_parallel_size / virtual_pipeline_model_parallel_size
parallel.tp_size                tensor_model_parallel_size (sequence_parallel likewise)
parallel.microbatch_group_size  microbatch_group_size_per_vp_stage
graph.cuda_graph_scope          cuda_graph_scope (``mhc_recompute`` -> mhc_recompute_graph)
graph.backend                   cuda_graph_impl: ``te`` -> transformer_engine (megatron-core's
                                TECudaGraphHelper captures the layers); cuda/tape/auto -> none
                                (mhc_cg's own graphed callables capture them)
==============================  =============================================================

Normalisation is RMSNorm (as mhc_cg's model). What a CPU run changes, and only a CPU run
(:data:`CPU_CHANGES`, each with its reason): the fusions whose kernels need CUDA off, and dev's
fused mHC kernels (Triton, cuTile) off. On a GPU Megatron's fields keep their values.

Megatron-LM main's and dev's spellings and settings, where they differ
(:func:`megatron_config_kwargs`):

==============================  =============================================================
RunConfig                       Megatron-LM main's TransformerConfig
==============================  =============================================================
model.num_streams               main: enable_mhc_connections, mhc_num_residual_streams;
                                dev: enable_hyper_connections, num_residual_streams
                                (use_fused_mhc off on a CPU)
parallel.tp_size                tensor_model_parallel_size
parallel.sequence_parallel      sequence_parallel
parallel.ep_size                expert_model_parallel_size (dev; MoE)
model.num_experts, moe_top_k    num_moe_experts, moe_router_topk, moe_ffn_hidden_size,
  moe_ffn_hidden_size,          moe_layer_freq; the all-to-all dispatcher, experts one by one
  moe_layer_freq                (dev; main raises for a MoE MLP in its mHC layer)
model.recompute: block          recompute_granularity: selective, recompute_modules: [mhc]
train.dtype                     params_dtype / pipeline_dtype as a string ("bf16")
graph.cuda_graph_scope          cuda_graph_modules without ``mhc_recompute`` (returned apart:
                                mhc_cg captures the recompute graphs)
graph.backend                   always transformer_engine (megatron's TECudaGraphHelper);
                                ``cuda_graph_warmup_steps`` = ``WARMUP_STEPS``
==============================  =============================================================
"""

from __future__ import annotations

from typing import Any

from mhc_cg.config import RunConfig, check
from mhc_cg.config.choices import split_recompute_scope
from mhc_cg.core.dtypes import TORCH_DTYPES

# eager training steps before megatron's helper captures (its ``cuda_graph_warmup_steps``)
from mhc_cg.config.rules import MEGATRON_WARMUP_STEPS as WARMUP_STEPS

# what a CPU run sets, and why (a GPU run leaves these fields as Megatron has them)
CPU_CHANGES = {
    "bias_dropout_fusion": (False, "megatron's fused bias-dropout-add is a CUDA kernel"),
    "gradient_accumulation_fusion": (False, "its fused weight-gradient kernel needs APEX or "
                                            "TransformerEngine on CUDA"),
    "masked_softmax_fusion": (False, "the fused softmax is a CUDA kernel"),
    "apply_rope_fusion": (False, "the fused RoPE is TransformerEngine's or APEX's CUDA kernel"),
}
DEV_CPU_CHANGES = {"use_fused_mhc": (False, "dev's own fused mHC kernels are Triton/cuTile on "
                                             "CUDA; megatron.use_fused_mhc puts mhc_cg's in "
                                             "mhc_cg's runs")}


def cpu_changes(run_cfg: RunConfig, branch: str | None = None) -> dict[str, tuple[Any, str]]:
    """``{field: (value, why)}`` the mapping sets because ``run_cfg`` runs on a CPU; none on a
    GPU. ``branch``: ``"dev"`` adds dev's own fused mHC kernels."""
    if run_cfg.train.device == "cuda":
        return {}
    return {**CPU_CHANGES, **(DEV_CPU_CHANGES if branch == "dev" else {})}


# Megatron's MoE as its partial capture runs it: the all-to-all dispatcher (expert parallelism
# over gloo or NCCL), experts one by one (grouped GEMM needs CUDA), no token dropping; linear
# layers without biases, as MoE models train (megatron's local experts add theirs in place, on
# a view autograd refuses)
_MOE_SETTINGS = dict(add_bias_linear=False, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                     moe_permute_fusion=False, moe_router_load_balancing_type="aux_loss",
                     moe_aux_loss_coeff=1e-2)


def _shared_kwargs(run_cfg: RunConfig, branch: str | None = None) -> dict[str, Any]:
    """The fields both spellings share, and what a CPU run changes (``branch``: see
    :func:`cpu_changes`)."""
    m, t = run_cfg.model, run_cfg.train
    return dict(num_layers=m.num_layers, hidden_size=m.hidden_size,
                num_attention_heads=m.num_heads, ffn_hidden_size=m.ffn_hidden_size,
                hidden_dropout=m.hidden_dropout, attention_dropout=0.0,
                init_method_std=m.init_std, normalization="RMSNorm",
                mhc_sinkhorn_iterations=m.sinkhorn_iterations,
                mhc_init_gating_factor=m.init_gating_factor, bf16=t.dtype == "bf16",
                **{field: value for field, (value, _) in cpu_changes(run_cfg, branch).items()})


def transformer_config_kwargs(run_cfg: RunConfig) -> dict[str, Any]:
    """The keyword arguments of ``MHCTransformerConfig`` that ``run_cfg`` implies."""
    check(run_cfg)
    m, t, p = run_cfg.model, run_cfg.train, run_cfg.parallel
    scopes = run_cfg.graph.scopes
    kwargs = _shared_kwargs(run_cfg)
    kwargs.update(
        enable_hyper_connections=m.num_streams > 1,
        num_residual_streams=m.num_streams,
        mhc_recompute_layer_num=m.resolved_recompute_layers if m.recompute == "block" else None,
        mhc_dropout_impl=m.dropout_impl,
        mhc_kernels=m.kernels,
        params_dtype=TORCH_DTYPES[t.dtype],
        pipeline_dtype=TORCH_DTYPES[t.dtype],
        fp16=t.dtype == "fp16",
        use_cpu_initialization=t.device == "cpu",
        pipeline_model_parallel_size=p.pp_size,
        virtual_pipeline_model_parallel_size=p.vpp_size if p.vpp_size > 1 else None,
        microbatch_group_size_per_vp_stage=p.microbatch_group_size,
        tensor_model_parallel_size=p.tp_size, sequence_parallel=p.sequence_parallel,
        cuda_graph_scope=scopes,
        cuda_graph_impl="transformer_engine" if scopes and run_cfg.graph.backend == "te" else "none",
    )
    if m.is_moe:
        kwargs.update(num_moe_experts=m.num_experts, moe_router_topk=m.moe_top_k,
                      moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_layer_freq=m.moe_layer_freq,
                      expert_model_parallel_size=p.ep_size)
    if p.pp_size > 1 and t.device != "cuda":
        kwargs["batch_p2p_comm"] = False  # the batched path synchronizes CUDA; gloo sends one by one
    return kwargs


def to_transformer_config(run_cfg: RunConfig, **overrides: Any):
    """``run_cfg`` (validated first) as megatron-core's ``MHCTransformerConfig``; ``overrides`` win."""
    from megatron_integration.config.transformer_config import MHCTransformerConfig

    return MHCTransformerConfig(**{**transformer_config_kwargs(run_cfg), **overrides})


def megatron_config_kwargs(run_cfg: RunConfig, branch: str = "main") -> tuple[dict[str, Any], bool]:
    """``(Megatron-LM's TransformerConfig keyword arguments on branch main or dev, capture the
    recompute graphs)``.

    Types are plain (dtype as a string, ``"bf16"``): the arguments cross a process boundary as
    JSON; :func:`mhc_cg.lab.megatron_harness.runs.transformer_config` builds the config.
    """
    m, t, p = run_cfg.model, run_cfg.train, run_cfg.parallel
    layer_scopes, recompute_graph = split_recompute_scope(run_cfg.graph.scopes)
    kwargs = _shared_kwargs(run_cfg, branch)
    if branch == "main":
        kwargs.update(enable_mhc_connections=m.num_streams > 1, mhc_num_residual_streams=m.num_streams)
    else:  # dev's names (on a CPU its cuTile/Triton mHC kernels are off: cpu_changes)
        kwargs.update(enable_hyper_connections=m.num_streams > 1, num_residual_streams=m.num_streams)
    kwargs.update(
        recompute_granularity="selective", recompute_modules=["mhc"],
        mhc_recompute_layer_num=m.resolved_recompute_layers,
        params_dtype=t.dtype, pipeline_dtype=t.dtype,
        use_cpu_initialization=t.device != "cuda",
        cuda_graph_impl="transformer_engine", cuda_graph_modules=layer_scopes,
        cuda_graph_warmup_steps=WARMUP_STEPS,
        tensor_model_parallel_size=p.tp_size, sequence_parallel=p.sequence_parallel,
        pipeline_model_parallel_size=p.pp_size,
        virtual_pipeline_model_parallel_size=p.vpp_size if p.vpp_size > 1 else None,
        microbatch_group_size_per_vp_stage=p.microbatch_group_size)
    if m.is_moe:  # dev only (the rules refuse MoE on main)
        kwargs.update(num_moe_experts=m.num_experts, moe_router_topk=m.moe_top_k,
                      moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_layer_freq=m.moe_layer_freq,
                      expert_model_parallel_size=p.ep_size, **_MOE_SETTINGS)
    if p.pp_size > 1 and t.device != "cuda":
        kwargs["batch_p2p_comm"] = False  # the batched path synchronizes CUDA; gloo sends one by one
    return kwargs, recompute_graph
