"""``MHCTransformerConfig``: megatron-core's ``TransformerConfig`` with the mHC fields.

Field names follow Megatron-LM's ``dev`` branch (``enable_hyper_connections``,
``num_residual_streams``); Megatron-LM ``main``'s spellings (``enable_mhc_connections``,
``mhc_num_residual_streams``) are accepted too and copied onto them. No megatron-core release
has mHC, so these fields are ours.

Graph scopes: ``mhc_recompute`` (capture the block recompute as its own graph) is not a value of
megatron-core's ``CudaGraphScope`` enum, which ``TransformerConfig.__post_init__`` converts every
scope to. It is removed from ``cuda_graph_scope`` (0.16-0.17) or ``cuda_graph_modules`` (0.18+)
before megatron-core sees the list, and kept here as ``mhc_recompute_graph = True``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.core.transformer import TransformerConfig

from mhc_cg.config.choices import DROPOUT_IMPLS, RECOMPUTE_SCOPE as MHC_SCOPE, split_recompute_scope
from mhc_cg.config.rules import choice_problems, recompute_graph_problems
from mhc_cg.ops.kernels import KERNELS

# megatron-core 0.18 renamed cuda_graph_scope to cuda_graph_modules; 0.16 knows only the former.
HAS_CUDA_GRAPH_MODULES = "cuda_graph_modules" in {f.name for f in dataclasses.fields(TransformerConfig)}

# Megatron-LM main's spelling -> the dev branch's (ours).
MAIN_BRANCH_ALIASES = {"enable_mhc_connections": "enable_hyper_connections",
                       "mhc_num_residual_streams": "num_residual_streams"}


@dataclass
class MHCTransformerConfig(TransformerConfig):
    """A ``TransformerConfig`` for layers with mHC around attention and MLP."""

    enable_hyper_connections: bool = False
    """Widen the residual stream to ``num_residual_streams * hidden_size`` (mHC)."""

    num_residual_streams: int = 4
    """n, the number of residual streams."""

    mhc_sinkhorn_iterations: int = 20
    """Sinkhorn-Knopp iterations that make H_res doubly stochastic."""

    mhc_init_gating_factor: float = 0.01
    """Initial alpha_pre / alpha_post / alpha_res."""

    mhc_recompute_layer_num: int | None = None
    """L_r, layers per recompute block; ``None``: keep every mHC intermediate (no recompute).
    A block never crosses a pipeline stage: it must divide the layers of a model chunk."""

    mhc_recompute_graph: bool = False
    """Capture the block recompute as a graph (set by ``mhc_recompute`` in the graph scope)."""

    mhc_dropout_impl: str = "torch"
    """Dropout after H_post: ``torch`` (stateful generator, as megatron-core) or ``counter``
    (mask = hash(seed, index), replayable by a graph)."""

    mhc_kernels: str = "auto"
    """Fused mHC ops (``mhc_cg.ops.kernels``): ``auto`` (Triton on CUDA, torch on CPU), ``torch``, ``triton``."""

    enable_mhc_connections: bool | None = None
    """Megatron-LM main's name for ``enable_hyper_connections``."""

    mhc_num_residual_streams: int | None = None
    """Megatron-LM main's name for ``num_residual_streams``."""

    if not HAS_CUDA_GRAPH_MODULES:  # accept the newer spelling on megatron-core 0.16-0.17 too
        cuda_graph_modules: list[str] | None = None
        """megatron-core >= 0.18's name for ``cuda_graph_scope``."""

    def __post_init__(self) -> None:
        self._apply_aliases()
        self._take_mhc_scope()
        super().__post_init__()  # converts the remaining scopes to CudaGraphScope
        self._check_mhc()

    def _apply_aliases(self) -> None:
        for alias, name in MAIN_BRANCH_ALIASES.items():
            value = getattr(self, alias)
            if value is None:
                continue
            default = next(f.default for f in dataclasses.fields(self) if f.name == name)
            current = getattr(self, name)
            if current != default and current != value:
                raise ValueError(f"{alias}={value!r} (Megatron-LM main's spelling) disagrees with "
                                 f"{name}={current!r}; set one of them")
            setattr(self, name, value)

    def _take_mhc_scope(self) -> None:
        """Remove ``mhc_recompute`` from the scope lists megatron-core will parse."""
        if not HAS_CUDA_GRAPH_MODULES and self.cuda_graph_modules is not None:
            modules, scope = list(self.cuda_graph_modules), _scope_list(self.cuda_graph_scope)
            if scope not in ([], ["full"]) and set(scope) != set(modules):
                raise ValueError(f"cuda_graph_modules={modules} disagrees with "
                                 f"cuda_graph_scope={scope}; they are one setting, keep one")
            self.cuda_graph_scope = modules
            self.cuda_graph_modules = None
        names = ["cuda_graph_scope"] + (["cuda_graph_modules"] if HAS_CUDA_GRAPH_MODULES else [])
        for name in names:
            value = getattr(self, name)
            if value is None or not _scope_list(value) or not all(
                    isinstance(s, str) for s in _scope_list(value)):
                continue  # already enums (megatron-core parsed it), or empty
            scopes, listed = split_recompute_scope(_scope_list(value))
            if listed:
                self.mhc_recompute_graph = True
                if not scopes and self.cuda_graph_impl != "none":
                    # megatron-core reads an empty scope as "capture the whole layer".
                    raise ValueError(f"{name}=['{MHC_SCOPE}'] leaves megatron-core an empty scope, "
                                     f"which it reads as the whole layer; list the layer scopes "
                                     f"(e.g. ['attn', '{MHC_SCOPE}']) or set cuda_graph_impl='none'")
                setattr(self, name, scopes)

    def _check_mhc(self) -> None:
        problems = []
        if self.num_residual_streams < 1:
            problems.append(f"num_residual_streams must be >= 1, got {self.num_residual_streams}")
        problems += choice_problems(("mhc_dropout_impl", self.mhc_dropout_impl, DROPOUT_IMPLS),
                                    ("mhc_kernels", self.mhc_kernels, KERNELS))
        if self.mhc_recompute_layer_num is not None and self.mhc_recompute_layer_num < 1:
            problems.append(f"mhc_recompute_layer_num must be >= 1 or None, "
                            f"got {self.mhc_recompute_layer_num}")
        if self.mhc_recompute_graph:
            problems += recompute_graph_problems(
                mhc_on=self.enable_hyper_connections,
                block_recompute=self.mhc_recompute_layer_num is not None,
                dropout_impl=self.mhc_dropout_impl, dropout=self.hidden_dropout, fields=dict(
                    scope="cuda_graph_scope", mhc="enable_hyper_connections is False",
                    mhc_fix="set enable_hyper_connections=True",
                    recompute="mhc_recompute_layer_num is None",
                    recompute_fix="set mhc_recompute_layer_num (layers per recompute block)",
                    dropout_impl="mhc_dropout_impl", dropout="hidden_dropout"))
        if problems:
            raise ValueError("MHCTransformerConfig: " + "; ".join(problems))

    @property
    def mhc_recompute(self) -> bool:
        """Block recompute of the mHC intermediates is on."""
        return self.enable_hyper_connections and self.mhc_recompute_layer_num is not None


def _scope_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [s for s in value.split(",") if s]
    return list(value) if isinstance(value, (list, tuple)) else [value]
