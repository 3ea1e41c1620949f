"""Every rule of a run config, one home each: one line per broken rule, naming the field and the fix.

* a section's own rules (:func:`model_problems`, :func:`train_problems`) run when the section is
  built (:mod:`mhc_cg.config.schema`), so a config made in code obeys them too;
* the rules between sections (scopes vs model, pipeline vs layers, sizes) are :func:`validate`;
  :func:`check` raises ``ConfigError`` with all of them, and ``load_config`` calls it, so every
  command that reads a YAML file reports them the same way (exit status 2);
* rules that depend on where or how a config runs take that as an argument:
  :func:`device_fit_problems` (the device's memory), :func:`pipeline_driver_problems` (one process
  per pipeline rank), :func:`recompute_graph_problems` (shared with megatron's config, under its
  field names).

What the scopes mean, and the capture plan they resolve to: :mod:`mhc_cg.modes.plan`.

The sections these rules read are :mod:`mhc_cg.config.schema`'s (``cfg`` a ``RunConfig``,
``model`` an ``MHCGPTConfig``, ``train`` a ``TrainConfig``), named here and not imported: the
schema runs a section's rules when it is built, so the import runs one way, schema to rules.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from mhc_cg.config.choices import (ARITHMETICS, DEVICES, DROPOUT_IMPLS, GRAPH_BACKENDS, MIN_VOCAB_SIZE,
                                   MODEL_RECOMPUTE, MOE_SCOPES, RECOMPUTE_SCOPE, RESIDUALS,
                                   SCOPES, split_recompute_scope)
from mhc_cg.core.dtypes import DTYPE_BYTES, TRAIN_DTYPES
from mhc_cg.core.errors import ConfigError, did_you_mean, is_positive_int
from mhc_cg.core.pipeline_order import schedule_problems
from mhc_cg.ops.dropout import stateful_dropout_problem
from mhc_cg.ops.kernels import KERNELS, kernels_problem

# Megatron-LM / MindSpeed recompute options a user may carry over, and what they map to here.
# mhc_cg has no full-layer recompute: model.recompute: block re-runs only the mHC ops, never F.
# Megatron's rules for mixing activation recompute with full recompute (only method 'block'; the
# full-recompute layers come first, then the activation-recompute layers; no layer does both; the
# two counts add up to num_layers without pipelining) therefore have nothing to split here.
FOREIGN_RECOMPUTE_FIELDS = {
    "recompute_granularity": "mhc_cg has no full-layer or selective recompute of F; "
                             "model.recompute: block recomputes the mHC ops, and "
                             "model.recompute_activation the MLP's gelu",
    "recompute_method": "mhc_cg has no full-layer recompute, so no method; model.recompute: block "
                        "recomputes the mHC ops in blocks of model.recompute_layers",
    "recompute_num_layers": "mhc_cg has no full-layer recompute; for mHC block recompute use "
                            "model.recompute_layers (layers per block), for gelu recompute "
                            "model.recompute_activation_layers",
    "recompute_activation_function": "MindSpeed's --recompute-activation-function is "
                                     "model.recompute_activation here",
    "recompute_activation_function_num_layers": "MindSpeed's "
                                                "--recompute-activation-function-num-layers is "
                                                "model.recompute_activation_layers here",
}

# --------------------------------------------------------------------------------------------
# A section's own rules (run when it is built).

_MODEL_POSITIVE = ("vocab_size", "seq_length", "hidden_size", "num_heads", "num_layers",
                   "num_streams", "ffn_hidden_size", "sinkhorn_iterations")


def model_problems(model) -> list[str]:
    """The ``model`` section's rules, field by field and between its fields."""
    problems = [f"model.{name}: must be a positive integer, got {getattr(model, name)!r}"
                for name in _MODEL_POSITIVE if not is_positive_int(getattr(model, name))]
    if is_positive_int(model.hidden_size) and is_positive_int(model.num_heads) \
            and model.hidden_size % model.num_heads:
        problems.append(f"model.num_heads: must divide hidden_size={model.hidden_size}, "
                        f"got {model.num_heads}")
    if not (isinstance(model.hidden_dropout, (int, float)) and 0.0 <= model.hidden_dropout < 1.0):
        problems.append(f"model.hidden_dropout: must be in [0, 1), got {model.hidden_dropout!r}")
    problems += choice_problems(("model.dropout_impl", model.dropout_impl, DROPOUT_IMPLS),
                                ("model.kernels", model.kernels, KERNELS),
                                ("model.recompute", model.recompute, MODEL_RECOMPUTE),
                                ("model.residual", model.residual, RESIDUALS),
                                ("model.arithmetic", model.arithmetic, ARITHMETICS))
    if model.residual == "plain" and (model.num_streams != 1 or model.recompute != "none"):
        problems.append(f"model.residual: plain has one stream and no mHC to recompute; set "
                        f"model.num_streams: 1 and model.recompute: none (got "
                        f"{model.num_streams} and {model.recompute!r})")
    if model.recompute_layers is not None and not is_positive_int(model.recompute_layers):
        problems.append(f"model.recompute_layers: must be a positive integer or null, "
                        f"got {model.recompute_layers!r}")
    if model.num_experts is not None and not (
            is_positive_int(model.num_experts) and isinstance(model.moe_top_k, int)
            and 1 <= model.moe_top_k <= model.num_experts):
        problems.append(f"model.moe_top_k: must be in [1, num_experts={model.num_experts}], "
                        f"got {model.moe_top_k!r}")
    problems += _moe_layer_freq_problems(model)
    if not is_positive_int(model.moe_ffn_hidden_size):
        problems.append(f"model.moe_ffn_hidden_size: must be a positive integer or null "
                        f"(null: ffn_hidden_size), got {model.moe_ffn_hidden_size!r}")
    return problems + activation_recompute_problems(model)


def _moe_layer_freq_problems(model) -> list[str]:
    freq = model.moe_layer_freq
    if freq == 1:
        return []
    if model.num_experts is None:
        return [f"model.moe_layer_freq: {freq!r} places MoE layers, but the model is dense; set "
                f"model.num_experts, or moe_layer_freq: 1"]
    if is_positive_int(freq):
        return []
    layers = model.num_layers
    if isinstance(freq, list) and isinstance(layers, int) and len(freq) == layers \
            and all(v in (0, 1) and not isinstance(v, bool) for v in freq) and any(freq):
        return []
    return [f"model.moe_layer_freq: must be a positive integer (every N-th layer MoE) or a list "
            f"of {layers} entries of 0 (dense) and 1 (MoE) with at least one 1, got {freq!r}"]


def train_problems(train) -> list[str]:
    """The ``train`` section's rules."""
    problems = [f"train.{name}: must be a positive integer, got {getattr(train, name)!r}"
                for name in ("steps", "micro_batch_size", "num_microbatches", "eval_batches")
                if getattr(train, name) < 1]
    if train.eval_interval < 0:
        problems.append(f"train.eval_interval: must be >= 0 (0: no evaluation), got "
                        f"{train.eval_interval!r}")
    if not (math.isfinite(train.lr) and train.lr > 0):
        problems.append(f"train.lr: must be a finite number > 0 (e.g. 3e-3), got {train.lr!r}")
    if not (math.isfinite(train.weight_decay) and train.weight_decay >= 0):
        problems.append(f"train.weight_decay: must be a finite number >= 0 (0 turns it off), "
                        f"got {train.weight_decay!r}")
    return problems + choice_problems(("train.device", train.device, DEVICES),
                                      ("train.dtype", train.dtype, TRAIN_DTYPES))


def choice_problems(*fields: tuple[str, object, tuple]) -> list[str]:
    """``(field, value, allowed)`` -> one line for each value that is not among its allowed ones."""
    return [f"{field}: must be one of {list(allowed)}, got {value!r}"
            for field, value, allowed in fields if value not in allowed]


# schedule_problems names its arguments; these are the fields a user edits.
_SCHEDULE_FIELDS = {"pp_size": "parallel.pp_size", "vpp_size": "parallel.vpp_size",
                    "microbatch_group_size": "parallel.microbatch_group_size",
                    "num_microbatches": "train.num_microbatches"}


def validate(cfg, unknown=frozenset()) -> list[str]:
    """Every cross-section problem of ``cfg``, one line each; empty when the config is consistent.

    Rules within the model section (activation recompute included) are ``MHCGPTConfig``'s own:
    a config that reached here has passed them. ``unknown`` names fields (``section.field``, or a
    whole section) whose value in ``cfg`` is a stand-in for one already reported
    (:meth:`~mhc_cg.config.schema.RunConfig.build`): the lines that name them are left out.
    """
    problems = [*_graph_problems(cfg), *_scope_problems(cfg), *_pipeline_problems(cfg),
                *_size_problems(cfg), *_kernel_problems(cfg)]
    return [line for line in problems if not mentions_any(line, unknown)]


def mentions_any(line: str, names) -> bool:
    """Whether ``line`` names one of ``names``: ``section.field`` as written or quoted as
    ``field=value``; a bare ``section``, any of its fields or the section itself."""
    for name in names:
        section, _, field = name.partition(".")
        pattern = (rf"(?<![\w.])(?:{section}\.{field}(?!\w)|{field}=)" if field
                   else rf"(?<![\w.]){section}(?:\.\w|:)")
        if re.search(pattern, line):
            return True
    return False


def _kernel_problems(cfg) -> list[str]:
    """``model.kernels`` on a config that names the CPU (on ``cuda``/``auto`` the device is
    known where the run is planned: :func:`device_fit_problems`)."""
    if cfg.train.device != "cpu":
        return []
    problem = kernels_problem(cfg.model.kernels, cuda=False)
    return [problem] if problem else []


def check(cfg):
    """``cfg`` unchanged, or ``ConfigError`` listing every problem ``validate`` finds."""
    problems = validate(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def activation_recompute_problems(model) -> list[str]:
    """The rules for ``model.recompute_activation[_layers]``, one line per broken rule.

    Run by ``MHCGPTConfig`` itself, so a model built in code obeys them too. Activation
    recompute combines with ``recompute: none`` and ``recompute: block`` on any layer: mHC block
    recompute never re-runs F, so no layer would recompute its gelu twice (the seed's "no layer
    does both" rule has nothing to forbid here).
    """
    problems = []
    on, layers = model.recompute_activation, model.recompute_activation_layers
    if not isinstance(on, bool):
        problems.append(f"model.recompute_activation: must be true or false, got {on!r}")
        return problems
    if layers is not None:
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            problems.append(f"model.recompute_activation_layers: must be a positive integer (the "
                            f"first N layers recompute their gelu) or null for all layers, got "
                            f"{layers!r}")
        elif isinstance(model.num_layers, int) and layers > model.num_layers:
            problems.append(f"model.recompute_activation_layers: {layers} exceeds model.num_layers="
                            f"{model.num_layers}; use at most {model.num_layers}, or null for all "
                            f"layers")
        if not on:
            problems.append(f"model.recompute_activation_layers: set to {layers!r} but "
                            f"model.recompute_activation is false, so no layer would recompute "
                            f"its activation; set model.recompute_activation: true or remove "
                            f"recompute_activation_layers")
    if on and model.num_experts is not None:
        problems.append(f"model.recompute_activation: recomputes the dense MLP's gelu "
                        f"(fc1 -> gelu -> fc2), but every layer's MLP is MoE "
                        f"(model.num_experts={model.num_experts}); set model.num_experts: null or "
                        f"model.recompute_activation: false")
    return problems


def _graph_problems(cfg) -> list[str]:
    graph, problems = cfg.graph, []
    if graph.backend not in GRAPH_BACKENDS:
        problems.append(f"graph.backend: must be one of {list(GRAPH_BACKENDS)}, got "
                        f"{graph.backend!r}{did_you_mean(graph.backend, GRAPH_BACKENDS)}")
    if graph.backend == "cuda" and cfg.train.device == "cpu":
        problems.append("graph.backend: 'cuda' captures torch.cuda.CUDAGraph, but train.device is "
                        "'cpu'; set train.device: cuda (or auto), or graph.backend: tape for the "
                        "CPU emulation")
    old, new = graph.cuda_graph_scope, graph.cuda_graph_modules
    if old is not None and new is not None and set(old) != set(new):
        problems.append(f"graph.cuda_graph_modules: {new} disagrees with graph.cuda_graph_scope "
                        f"{old}; both name the same setting (megatron-core >= 0.18 renamed "
                        f"cuda_graph_scope to cuda_graph_modules): keep one of them")
    return problems


def _scope_problems(cfg) -> list[str]:
    model, name = cfg.model, cfg.graph.scope_field
    scopes = cfg.graph.scopes
    problems = []
    for scope in scopes:
        if scope not in SCOPES:
            problems.append(f"{name}: unknown scope {scope!r}{did_you_mean(scope, SCOPES)}; "
                            f"allowed: {', '.join(SCOPES)}")
    duplicates = sorted({s for s in scopes if scopes.count(s) > 1})
    if duplicates:
        problems.append(f"{name}: {duplicates} listed more than once; list each scope once")

    if RECOMPUTE_SCOPE in scopes:
        problems += recompute_graph_problems(
            mhc_on=model.num_streams >= 2, block_recompute=model.recompute == "block",
            dropout_impl=model.dropout_impl, dropout=model.hidden_dropout, fields=dict(
                scope=name, mhc=f"model.num_streams is {model.num_streams}",
                mhc_fix="set model.num_streams >= 2 (4 in the paper)",
                recompute=f"model.recompute is {model.recompute!r}",
                recompute_fix="set model.recompute: block",
                dropout_impl="model.dropout_impl", dropout="model.hidden_dropout"))

    moe_scopes = [s for s in scopes if s in MOE_SCOPES]
    if moe_scopes and not model.is_moe:
        problems.append(f"{name}: {moe_scopes} capture MoE layers, but the model is dense "
                        f"(model.num_experts is null); set model.num_experts or use 'mlp'")
    if "mlp" in scopes and model.is_moe and 0 not in model.moe_layer_pattern:
        problems.append(f"{name}: 'mlp' captures a dense MLP, but every layer's MLP is MoE "
                        f"(model.num_experts={model.num_experts}); use 'moe_router' "
                        f"[+ 'moe_preprocess'] instead")
    if "moe_preprocess" in scopes and "moe_router" not in scopes:
        problems.append(f"{name}: 'moe_preprocess' continues the router's graph, so it needs "
                        f"'moe_router' too; add 'moe_router'")
    if "moe" in scopes and "moe_router" in scopes:
        problems.append(f"{name}: 'moe' captures the whole MoE layer, router included, so it "
                        f"cannot be combined with 'moe_router'; keep one of them")
    if "moe" in scopes and model.is_moe and "moe_router" not in scopes:
        problems.append(f"{name}: 'moe' captures the whole MoE layer, but its token dispatch "
                        f"has data-dependent shapes (no drop-and-pad); use 'moe_router' "
                        f"[+ 'moe_preprocess'] (partial capture)")
    return problems


def recompute_graph_problems(*, mhc_on: bool, block_recompute: bool, dropout_impl: str,
                             dropout: float, fields: dict[str, str]) -> list[str]:
    """What ``mhc_recompute`` in a graph scope needs: mHC on, block recompute on, and a dropout
    mask a replayed graph can redraw. ``fields`` names the settings in the caller's config
    (``scope``, ``mhc``, ``mhc_fix``, ``recompute``, ``recompute_fix``, ``dropout_impl``,
    ``dropout``), so mhc_cg's YAML and megatron's ``TransformerConfig`` share the rule."""
    problems = []
    scope = fields["scope"]
    if not mhc_on:
        problems.append(f"{scope}: 'mhc_recompute' recomputes the mHC ops, but mHC is off "
                        f"({fields['mhc']}); {fields['mhc_fix']} or remove 'mhc_recompute'")
    if not block_recompute:
        problems.append(f"{scope}: 'mhc_recompute' captures the block recompute, but "
                        f"{fields['recompute']}; {fields['recompute_fix']} or remove "
                        f"'mhc_recompute'")
    problem = stateful_dropout_problem(dropout_impl, dropout, fields["dropout_impl"],
                                       fields["dropout"], also=f"or remove 'mhc_recompute' from {scope}")
    return problems + ([problem] if problem else [])


def _pipeline_problems(cfg) -> list[str]:
    par, model = cfg.parallel, cfg.model
    problems = []
    for line in schedule_problems(par.pp_size, 0, cfg.train.num_microbatches, par.vpp_size,
                                  par.microbatch_group_size):
        name, sep, rest = line.partition(":")
        problems.append(f"{_SCHEDULE_FIELDS.get(name, name)}{sep}{rest}")
    problems += _tensor_parallel_problems(cfg) + _expert_parallel_problems(cfg)
    if not all(isinstance(v, int) and v >= 1 for v in (par.pp_size, par.vpp_size)):
        return problems  # already reported; the rules below divide by them
    chunks = par.pp_size * par.vpp_size
    if model.num_layers % chunks:
        problems.append(f"model.num_layers: {model.num_layers} layers cannot be split into "
                        f"pp_size * vpp_size = {chunks} equal model chunks; use a multiple of "
                        f"{chunks}")
        return problems
    per_chunk = model.num_layers // chunks
    recomputing = model.recompute == "block" or RECOMPUTE_SCOPE in cfg.graph.scopes
    if recomputing and chunks > 1 and model.recompute_layers is not None \
            and per_chunk % model.recompute_layers:
        divisors = [d for d in range(1, per_chunk + 1) if per_chunk % d == 0]
        problems.append(f"model.recompute_layers: a recompute block of {model.recompute_layers} "
                        f"layers would cross a pipeline stage (each model chunk holds "
                        f"num_layers / (pp_size * vpp_size) = {per_chunk} layers); use one of "
                        f"{divisors}, or null for the paper's default per chunk")
    return problems


def _tensor_parallel_problems(cfg) -> list[str]:
    par, model = cfg.parallel, cfg.model
    tp = par.tp_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        return [f"parallel.tp_size: must be a positive integer, got {tp!r}"]
    problems = []
    if par.sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel: needs tensor parallelism; set parallel.tp_size "
                        "to 2 or more, or sequence_parallel: false")
    for name, value in (("num_heads", model.num_heads), ("ffn_hidden_size", model.ffn_hidden_size),
                        ("vocab_size", model.vocab_size)):
        if isinstance(value, int) and value % tp:
            problems.append(f"model.{name}: {value} does not split over parallel.tp_size={tp} "
                            f"ranks; use a multiple of {tp}")
    if par.sequence_parallel and isinstance(model.seq_length, int) and model.seq_length % tp:
        problems.append(f"model.seq_length: {model.seq_length} does not split over "
                        f"parallel.tp_size={tp} ranks under sequence_parallel; use a multiple of {tp}")
    return problems


def _expert_parallel_problems(cfg) -> list[str]:
    par, model = cfg.parallel, cfg.model
    ep = par.ep_size
    if not is_positive_int(ep):
        return [f"parallel.ep_size: must be a positive integer, got {ep!r}"]
    if ep == 1:
        return []
    if not model.is_moe:
        return [f"parallel.ep_size: {ep} splits MoE experts, but the model is dense; set "
                f"model.num_experts, or parallel.ep_size: 1"]
    if is_positive_int(model.num_experts) and model.num_experts % ep:
        return [f"parallel.ep_size: {ep} does not divide model.num_experts={model.num_experts}; "
                f"use a divisor of {model.num_experts}"]
    return []


def megatron_only_refusal(cfg) -> str | None:
    """The one line refusing a config to mhc_cg's own model (what ``mhc-cg train``, ``cost`` and
    ``bench`` train): no tensor or expert parallelism, every MLP MoE or none (Megatron's own
    layers have them: mhc-cg megatron)."""
    par, model = cfg.parallel, cfg.model
    for field, value, lacks in (("parallel.tp_size", par.tp_size, "no tensor parallelism"),
                                ("parallel.ep_size", par.ep_size, "no expert parallelism"),
                                ("model.moe_layer_freq", model.moe_layer_freq,
                                 "MoE in every layer or none")):
        if value != 1:
            return (f"{field}: {value}: mhc_cg's own model (mhc-cg train, cost, bench) has "
                    f"{lacks}; run Megatron's own layers with mhc-cg megatron, or set {field}: 1")
    return None


# No single device holds this much; a config beyond it is a typo (hidden_size: 1e20), refused
# before anything is allocated. What fits one device is checked against it when training starts.
MAX_TRAIN_BYTES = 2 ** 40


def estimated_train_bytes(cfg) -> int:
    """Rough bytes one training step holds: parameters and gradients in ``train.dtype``, fp32
    main parameters and AdamW state (mixed precision), and one microbatch's activations (about 24
    stream-wide tensors per layer, plus the seq x seq attention scores of the math path). An
    order-of-magnitude figure for refusing impossible sizes up front, not a memory model."""
    m, t = cfg.model, cfg.train
    c, n, s, layers = m.hidden_size, m.num_streams, m.seq_length, m.num_layers
    ffn = m.ffn_hidden_size if not m.is_moe else m.moe_ffn_hidden_size * m.num_experts
    per_layer = 4 * c * c + 2 * c * ffn + 2 * (n * c * (n * n + 2 * n) + c)
    params = 2 * m.vocab_size * c + s * c + layers * per_layer
    width = DTYPE_BYTES.get(t.dtype, 4)
    state = params * (2 * width + (16 if t.dtype != "fp32" else 12))
    activations = layers * t.micro_batch_size * s * width * (24 * n * c + 3 * ffn + m.num_heads * s)
    return state + activations


def _size_problems(cfg) -> list[str]:
    model, problems = cfg.model, []
    if model.vocab_size < MIN_VOCAB_SIZE:
        problems.append(f"model.vocab_size: {model.vocab_size} is too small for the synthetic "
                        f"corpus (progressions with strides up to 5); use at least "
                        f"{MIN_VOCAB_SIZE}")
    need = estimated_train_bytes(cfg)
    if need > MAX_TRAIN_BYTES:
        problems.append(f"model: training this model needs about {need / 2 ** 30:.3g} GiB "
                        f"(parameters, optimizer state, one microbatch's activations), beyond the "
                        f"limit of {MAX_TRAIN_BYTES / 2 ** 30:.0f} GiB that any one device holds; "
                        f"reduce model.hidden_size, num_layers, seq_length, ffn_hidden_size or "
                        f"train.micro_batch_size")
    return problems


def device_fit_problems(cfg, device_bytes: int | None, device_type: str) -> list[str]:
    """A run whose rough size (:func:`estimated_train_bytes`) exceeds what its device holds
    (``device_bytes``; ``None``: unknown), or whose ``model.kernels`` cannot run there, refused
    before anything is allocated."""
    problems = [p for p in (kernels_problem(cfg.model.kernels, device_type == "cuda"),) if p]
    need = estimated_train_bytes(cfg)
    if device_bytes is None or need <= device_bytes:
        return problems
    return problems + [f"model: training this model needs about {need / 2 ** 30:.3g} GiB (parameters, "
            f"optimizer state, one microbatch's activations), more than the "
            f"{device_bytes / 2 ** 30:.3g} GiB of {device_type} memory (the limit); reduce "
            f"model.hidden_size, num_layers, seq_length or train.micro_batch_size"]


def pipeline_driver_problems(cfg) -> list[str]:
    """What the multi-process pipeline driver (one process per rank, static buffers on every
    rank) does not run; empty when ``cfg`` can run on it."""
    problems = []
    if "mlp" in cfg.graph.scopes and not cfg.model.is_moe and cfg.model.recompute_activation:
        problems.append("model.recompute_activation: a graphed 'mlp' sublayer writes fc1's output "
                        "into the one persistent set it was captured with, and a pipeline keeps "
                        "several in flight; drop 'mlp' from graph.cuda_graph_scope or set "
                        "recompute_activation: false")
    if cfg.model.is_moe:
        problems.append("model.num_experts: the pipeline driver runs dense models; set "
                        "num_experts: null or parallel.pp_size: 1")
    if cfg.model.arithmetic == "v41":
        problems.append("model.arithmetic: v41 hands each sublayer the pre-mix of the site "
                        "before, and the pipeline driver sends a stage the streams alone; set "
                        "parallel.pp_size: 1, or arithmetic main or dev")
    return problems


# --------------------------------------------------------------------------------------------
# Megatron-LM's own mHC layer (main or dev) under its TE graph helper, on mhc_cg's runtime.

# eager training steps before megatron's helper captures (its ``cuda_graph_warmup_steps``)
MEGATRON_WARMUP_STEPS = 1
MEGATRON_BACKENDS = ("te", "auto")
# "core": the installed megatron-core release with mhc_cg's own mHC layer
MEGATRON_BRANCHES = ("main", "dev", "core")
# megatron's cuda_graph_impl under mhc-cg megatron: its TE graph helper, or dev's
# FullCudaGraphWrapper around forward_backward_func
FULL_ITERATION = "full_iteration"
MEGATRON_GRAPH_IMPLS = ("transformer_engine", FULL_ITERATION)
# processes one run starts on one machine (one per rank)
MEGATRON_MAX_RANKS = 8


# Megatron-LM's own training scripts mhc-cg megatron runs (megatron.entry), from the branch's
# entry snapshot; the hybrid stack is dev's
MEGATRON_ENTRIES = ("pretrain_gpt", "pretrain_hybrid")
EXAMPLE_FLAGS = Path(__file__).resolve().parents[2] / "examples" / "megatron"


def entry_field_problems(entry, flags) -> list[str]:
    """``megatron.entry`` and ``megatron.flags``: a script of ``MEGATRON_ENTRIES`` and the names
    of ``examples/megatron/flags.NAME`` files, given together."""
    if entry is None:
        return ["megatron.flags: given without megatron.entry; set megatron.entry: pretrain_gpt "
                "(or pretrain_hybrid), or drop megatron.flags"] if flags else []
    problems = choice_problems(("megatron.entry", entry, MEGATRON_ENTRIES))
    if not flags:
        problems.append(f"megatron.flags: empty; name the files of {EXAMPLE_FLAGS} the run "
                        f"takes, e.g. [tiny, cpu, dsv4, dsv4_mhc_cg]")
    missing = [name for name in flags if not (EXAMPLE_FLAGS / f"flags.{name}").is_file()]
    if missing:
        known = sorted(p.name[len("flags."):] for p in EXAMPLE_FLAGS.glob("flags.*"))
        problems.append(f"megatron.flags: {missing} not found as {EXAMPLE_FLAGS}/flags.NAME; "
                        f"known: {known}")
    return problems


def entry_problems(cfg) -> list[str]:
    """What a run of Megatron-LM's own entry (``megatron.entry``) needs beyond its fields."""
    m = cfg.megatron
    problems = []
    if m.entry == "pretrain_hybrid" and m.branch != "dev":
        problems.append(f"megatron.entry: pretrain_hybrid is Megatron-LM dev's hybrid stack; set "
                        f"megatron.branch: dev (got {m.branch!r})")
    if m.branch == "core":
        problems.append("megatron.entry: the core branch has no training entry here; set "
                        "megatron.branch: dev or main")
    if m.use_fused_mhc:
        problems.append("megatron.use_fused_mhc: with megatron.entry the flags say it "
                        "(--use-fused-mhc); drop megatron.use_fused_mhc")
    return problems


def megatron_problems(cfg) -> list[str]:
    """What Megatron-LM's ``HyperConnectionTransformerLayer`` (``megatron.branch``) under
    ``TECudaGraphHelper`` with mhc_cg's static-buffer recompute needs beyond the general rules."""
    m, t, p, g = cfg.model, cfg.train, cfg.parallel, cfg.graph
    branch = cfg.megatron.branch
    name = "megatron-core" if branch == "core" else f"Megatron-LM {branch}"
    problems = []
    if m.num_streams < 2:
        problems.append(f"model.num_streams: {m.num_streams} turns mHC off; set 2 or more (4 in the paper)")
    if m.recompute != "block":
        problems.append("model.recompute: mhc_cg's runtime is the mHC recompute; set model.recompute: "
                        "block (megatron's recompute_modules: [mhc])")
    # counter dropout replays (main's and dev's layers by opt-in), torch's does not
    problem = stateful_dropout_problem(m.dropout_impl, m.hidden_dropout, "model.dropout_impl",
                                       "model.hidden_dropout")
    if problem is not None:
        problems.append(problem)
    if m.is_moe and branch != "dev":
        problems.append(f"model.num_experts: MoE layers run on Megatron-LM dev's own mHC layers "
                        f"here ({name}'s {'raises for a MoE MLP' if branch == 'main' else 'run dense MLPs'}); "
                        f"set megatron.branch: dev, or model.num_experts: null")
    if m.is_moe and p.tp_size != 1 and not p.sequence_parallel:
        problems.append("parallel.sequence_parallel: Megatron's MoE layer refuses tensor "
                        "parallelism without it in training; set parallel.sequence_parallel: true")
    if m.recompute_activation:
        problems.append(f"model.recompute_activation: not wired for {name}'s MLP; set false")
    if t.dtype != "bf16":
        problems.append(f"train.dtype: {t.dtype!r}: megatron-core's TECudaGraphHelper makes each "
                        f"layer's static inputs bf16; set train.dtype: bf16")
    if branch == "main" and (p.pp_size != 1 or p.vpp_size != 1):
        problems.append(f"parallel.pp_size: {p.pp_size} x vpp_size {p.vpp_size}: Megatron-LM main "
                        f"refuses mHC with pipeline parallelism; set pp_size: 1 and vpp_size: 1, "
                        f"or megatron.branch: dev")
    if branch == "main" and p.tp_size != 1:
        problems.append(f"parallel.tp_size: {p.tp_size}: tensor parallelism runs on Megatron-LM "
                        f"dev's layers and on megatron-core with mhc_cg's layer here; set "
                        f"megatron.branch: dev or core, or tp_size: 1")
    sizes = (p.tp_size, p.pp_size, p.ep_size)
    if all(isinstance(v, int) for v in sizes) and math.prod(sizes) > MEGATRON_MAX_RANKS:
        problems.append(f"parallel.tp_size x pp_size x ep_size: {math.prod(sizes)} processes; one "
                        f"machine runs at most {MEGATRON_MAX_RANKS} ranks here")
    if cfg.megatron.use_fused_mhc and branch == "core":
        problems.append("megatron.use_fused_mhc: mhc_cg's own layer on megatron-core runs its own "
                        "ops; use_fused_mhc is for Megatron-LM main's and dev's layers: set "
                        "megatron.branch: main or dev, or megatron.use_fused_mhc: false")
    if cfg.megatron.cuda_graph_impl == FULL_ITERATION:
        return problems + _full_iteration_problems(cfg)
    if g.backend not in MEGATRON_BACKENDS:
        problems.append(f"graph.backend: {g.backend!r}: megatron's TECudaGraphHelper captures with "
                        f"TransformerEngine's make_graphed_callables; set graph.backend: te (or auto)")
    problems += _megatron_scope_problems(g.scopes, g.scope_field, m.is_moe)
    if t.steps <= MEGATRON_WARMUP_STEPS:
        problems.append(f"train.steps: {t.steps}: the first {MEGATRON_WARMUP_STEPS} step runs eagerly before "
                        f"megatron's helper captures; set train.steps to {MEGATRON_WARMUP_STEPS + 1} or more")
    return problems


def _full_iteration_problems(cfg) -> list[str]:
    """What ``megatron.cuda_graph_impl: full_iteration`` (Megatron-LM dev's
    ``FullCudaGraphWrapper``: the whole forward and backward of a step, one graph) needs."""
    m, t, g = cfg.model, cfg.train, cfg.graph
    problems = []
    if cfg.megatron.branch != "dev":
        problems.append(f"megatron.cuda_graph_impl: full_iteration runs Megatron-LM dev's "
                        f"FullCudaGraphWrapper here, not {cfg.megatron.branch}'s; set "
                        f"megatron.branch: dev")
    if g.scopes:
        problems.append(f"{g.scope_field}: {g.scopes}: Megatron graphs the whole iteration with "
                        f"cuda_graph_impl: full_iteration and wants no layer scopes (dev refuses "
                        f"them); remove {g.scope_field}")
    if g.backend != "auto":
        problems.append(f"graph.backend: {g.backend!r}: dev's FullCudaGraphWrapper captures with "
                        f"torch.cuda.CUDAGraph (the tape on a CPU), not with a backend chosen "
                        f"here; set graph.backend: auto")
    if m.is_moe:
        problems.append(f"model.num_experts: {m.num_experts}: the MoE all-to-all's splits depend "
                        f"on the routing, which one graph of the whole iteration cannot hold; set "
                        f"model.num_experts: null, or megatron.cuda_graph_impl: transformer_engine")
    if t.steps < MEGATRON_WARMUP_STEPS + 2:
        problems.append(f"train.steps: {t.steps}: the first {MEGATRON_WARMUP_STEPS} step runs "
                        f"eagerly, the next is captured, the ones after replay; set train.steps to "
                        f"{MEGATRON_WARMUP_STEPS + 2} or more")
    return problems


def _megatron_scope_problems(scopes: list[str], field: str, moe: bool) -> list[str]:
    layer_scopes, _ = split_recompute_scope(scopes)
    fix = (f"set {field}: [attn, moe_router, moe_preprocess, {RECOMPUTE_SCOPE}]" if moe else
           f"set {field}: [attn, {RECOMPUTE_SCOPE}] (or [attn, mlp, {RECOMPUTE_SCOPE}])")
    problems = []
    if "attn" not in layer_scopes:
        problems.append(f"{field}: {scopes} graphs no layer, but megatron's helper graphs the "
                        f"attention sublayer with its mHC ops; {fix}")
    others = [s for s in layer_scopes if s not in ("attn", "mlp", *MOE_SCOPES)]
    if others:
        problems.append(f"{field}: {others} not supported with mhc_cg under megatron's helper; "
                        f"{fix}")
    return problems
