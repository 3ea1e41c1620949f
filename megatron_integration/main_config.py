"""mhc_cg's YAML (``RunConfig``) as Megatron-LM main's ``TransformerConfig``, for main's own mHC layer.

``main_config_kwargs(cfg)`` gives the keyword arguments of ``main``'s ``TransformerConfig`` and
whether mhc_cg captures the recompute graphs:

==============================  =============================================================
RunConfig                       Megatron-LM main's TransformerConfig
==============================  =============================================================
model.num_layers/hidden_size    num_layers / hidden_size (num_heads: num_attention_heads)
model.num_streams               enable_mhc_connections, mhc_num_residual_streams
model.sinkhorn_iterations       mhc_sinkhorn_iterations (init_gating_factor: mhc_init_gating_factor)
model.recompute: block          recompute_granularity: selective, recompute_modules: [mhc]
model.recompute_layers          mhc_recompute_layer_num (L_r)
train.dtype: bf16               params_dtype, pipeline_dtype bf16, bf16: true
graph.backend te / auto         cuda_graph_impl: transformer_engine (megatron's TECudaGraphHelper)
graph.cuda_graph_modules        cuda_graph_modules without ``mhc_recompute``, which megatron's
                                enum does not have (it raises ``KeyError``); kept here as the
                                recompute-graph flag
==============================  =============================================================

``megatron_problems(cfg)`` are the rules of running ``main``'s layer under its helper with
mhc_cg's recompute, one line each naming the field and the fix; ``load_config`` has checked the
general ones. Importing this module imports nothing from megatron.
"""

from __future__ import annotations

from typing import Any

from mhc_cg.config import RunConfig
from mhc_cg.config.choices import RECOMPUTE_SCOPE

# eager training steps before megatron's helper captures (its ``cuda_graph_warmup_steps``)
WARMUP_STEPS = 1
MEGATRON_BACKENDS = ("te", "auto")


def split_recompute_scope(scopes: list[str]) -> tuple[list[str], bool]:
    """``(scopes megatron knows, whether 'mhc_recompute' was listed)``."""
    return [s for s in scopes if s != RECOMPUTE_SCOPE], RECOMPUTE_SCOPE in scopes


def megatron_problems(cfg: RunConfig) -> list[str]:
    """What ``main``'s ``HyperConnectionTransformerLayer`` under ``TECudaGraphHelper`` with
    mhc_cg's static-buffer recompute needs beyond the general rules."""
    m, t, p, g = cfg.model, cfg.train, cfg.parallel, cfg.graph
    problems = []
    if m.num_streams < 2:
        problems.append(f"model.num_streams: {m.num_streams} turns mHC off; set 2 or more (4 in the paper)")
    if m.recompute != "block":
        problems.append("model.recompute: mhc_cg's runtime is the mHC recompute; set model.recompute: "
                        "block (megatron's recompute_modules: [mhc])")
    if m.dropout_impl != "torch":
        problems.append(f"model.dropout_impl: Megatron-LM main's mHC layer draws its dropout from "
                        f"torch's generator, not {m.dropout_impl!r}; set model.dropout_impl: torch")
    if m.hidden_dropout != 0:
        problems.append(f"model.hidden_dropout: {m.hidden_dropout}: main's mHC dropout draws from "
                        f"torch's stateful generator, which a recompute into static slots cannot "
                        f"rewind; set model.hidden_dropout: 0")
    if m.is_moe:
        problems.append("model.num_experts: Megatron-LM main refuses MoE MLPs inside "
                        "HyperConnectionTransformerLayer; set model.num_experts: null")
    if m.recompute_activation:
        problems.append("model.recompute_activation: not wired for Megatron-LM main's MLP; set false")
    if t.dtype != "bf16":
        problems.append(f"train.dtype: {t.dtype!r}: megatron-core's TECudaGraphHelper makes each "
                        f"layer's static inputs bf16; set train.dtype: bf16")
    if p.pp_size != 1 or p.vpp_size != 1:
        problems.append(f"parallel.pp_size: {p.pp_size} x vpp_size {p.vpp_size}: Megatron-LM main "
                        f"refuses mHC with pipeline parallelism; set pp_size: 1 and vpp_size: 1")
    if g.backend not in MEGATRON_BACKENDS:
        problems.append(f"graph.backend: {g.backend!r}: megatron's TECudaGraphHelper captures with "
                        f"TransformerEngine's make_graphed_callables; set graph.backend: te (or auto)")
    problems += _scope_problems(g.scopes, g.scope_field)
    if t.steps <= WARMUP_STEPS:
        problems.append(f"train.steps: {t.steps}: the first {WARMUP_STEPS} step runs eagerly before "
                        f"megatron's helper captures; set train.steps to {WARMUP_STEPS + 1} or more")
    return problems


def _scope_problems(scopes: list[str], field: str) -> list[str]:
    layer_scopes, _ = split_recompute_scope(scopes)
    fix = f"set {field}: [attn, {RECOMPUTE_SCOPE}]"
    problems = []
    if "attn" not in layer_scopes:
        problems.append(f"{field}: {scopes} graphs no layer, but megatron's helper graphs the "
                        f"attention sublayer with its mHC ops; {fix}")
    others = [s for s in layer_scopes if s != "attn"]
    if others:
        problems.append(f"{field}: {others} not supported with mhc_cg under megatron's helper yet "
                        f"(the MLP sublayer runs eagerly on the static runtime); {fix}")
    return problems


def main_config_kwargs(cfg: RunConfig) -> tuple[dict[str, Any], bool]:
    """``(TransformerConfig keyword arguments for main, capture the recompute graphs)``.

    Types are plain (dtype as a string, ``"bf16"``): the arguments cross a process boundary as
    JSON; :func:`megatron_integration.main_runs.main_transformer_config` builds the config.
    """
    m, t, g = cfg.model, cfg.train, cfg.graph
    layer_scopes, recompute_graph = split_recompute_scope(g.scopes)
    kwargs: dict[str, Any] = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        ffn_hidden_size=m.ffn_hidden_size, hidden_dropout=m.hidden_dropout, attention_dropout=0.0,
        init_method_std=m.init_std, normalization="RMSNorm",
        enable_mhc_connections=m.num_streams > 1, mhc_num_residual_streams=m.num_streams,
        mhc_sinkhorn_iterations=m.sinkhorn_iterations,
        mhc_init_gating_factor=m.init_gating_factor,
        recompute_granularity="selective", recompute_modules=["mhc"],
        mhc_recompute_layer_num=m.resolved_recompute_layers,
        params_dtype=t.dtype, pipeline_dtype=t.dtype, bf16=t.dtype == "bf16",
        use_cpu_initialization=t.device != "cuda",
        cuda_graph_impl="transformer_engine", cuda_graph_modules=layer_scopes,
        cuda_graph_warmup_steps=WARMUP_STEPS,
        # fusions that need CUDA extensions
        bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False)
    return kwargs, recompute_graph
