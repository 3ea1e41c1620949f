"""The run configuration: five sections as dataclasses, what each field holds and its default.

A YAML file has up to five sections, each optional::

    model:    MHCGPTConfig fields (shape, dropout, recompute)
    train:    TrainConfig fields (steps, batch, optimiser, device)
    parallel: ParallelConfig fields (pipeline schedule, tensor parallelism)
    graph:    GraphConfig fields (capture backend and scope)
    megatron: MegatronConfig fields (which Megatron-LM ``mhc-cg megatron`` runs)

Building a section checks it against its rules (:mod:`mhc_cg.config.rules`), so a config built in
code obeys the same rules as one read from YAML (:mod:`mhc_cg.config.load`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field

from mhc_cg.config import rules
from mhc_cg.core.errors import ConfigError, did_you_mean
from mhc_cg.ops.dropout import draws_from_generator

def paper_block_size(num_streams: int, num_layers: int) -> int:
    """L_r* = sqrt(n L / (n + 2)) (mHC paper, Eq. 20), rounded, within [1, L]."""
    return max(1, min(num_layers, round(math.sqrt(num_streams * num_layers / (num_streams + 2)))))


def _raise_problems(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


@dataclass
class MHCGPTConfig:
    """The ``model`` section: the mHC GPT's shape, dropout, recompute and kernels."""

    vocab_size: int = 64
    seq_length: int = 32
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 4
    num_streams: int = 4
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    hidden_dropout: float = 0.1
    dropout_impl: str = "counter"  # "counter": graph-replayable; "torch": stateful generator
    sinkhorn_iterations: int = 20
    init_gating_factor: float = 0.01
    init_std: float = 0.02
    recompute: str = "none"  # "none" | "block"
    recompute_layers: int | None = None  # L_r; None: the paper's sqrt(n*L/(n+2))
    num_experts: int | None = None  # None: dense MLP; else a top-k routed MoE MLP
    moe_top_k: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    # which layers are MoE (Megatron's moe_layer_freq): every N-th from the first, or one 0/1
    # per layer; anything but 1 runs under mhc-cg megatron only
    moe_layer_freq: int | list[int] = 1
    recompute_activation: bool = False  # drop the MLP's gelu output, recompute it
    recompute_activation_layers: int | None = None  # the first N layers do it; None: all
    kernels: str = "auto"  # fused mHC ops: "auto" (triton on CUDA, torch on CPU) | "torch" | "triton"
    residual: str = "mhc"  # "mhc" | "plain": x + dropout(F(norm(x))), the baseline of mHC's cost
    # the mHC arithmetic: "main" (the paper's, Megatron-LM main) | "dev" (DeepSeek-V4's,
    # Megatron-LM dev) | "v41" (DeepSeek-V4.1's delayed pre: mhc_cg.model.delayed_pre)
    arithmetic: str = "main"

    @property
    def draws_random(self) -> bool:
        """A training forward draws from torch's generators (torch's dropout, above 0)."""
        return draws_from_generator(self.dropout_impl, self.hidden_dropout)

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        _raise_problems(rules.model_problems(self))

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_layer_pattern(self) -> list[int]:
        """One entry per layer, 1 where its MLP is MoE (all 0 for a dense model), as Megatron
        reads ``moe_layer_freq``."""
        if not self.is_moe:
            return [0] * self.num_layers
        if isinstance(self.moe_layer_freq, list):
            return list(self.moe_layer_freq)
        return [int(i % self.moe_layer_freq == 0) for i in range(self.num_layers)]

    @property
    def resolved_recompute_layers(self) -> int:
        """L_r: the configured block size, or the paper's optimum sqrt(n*L/(n+2)), within [1, L]."""
        if self.recompute_layers is not None:
            return min(self.recompute_layers, self.num_layers)
        return paper_block_size(self.num_streams, self.num_layers)

    def recompute_activation_of(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (0-based, of the whole model) recomputes its gelu."""
        if not self.recompute_activation:
            return False
        return self.recompute_activation_layers is None or layer_number < self.recompute_activation_layers


@dataclass
class TrainConfig:
    """The ``train`` section: steps, batch, optimiser, device and precision."""

    steps: int = 60
    micro_batch_size: int = 8
    num_microbatches: int = 1  # microbatches per step (gradient accumulation / pipeline depth)
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 1234
    device: str = "cpu"  # "cpu" | "cuda" | "auto"
    dtype: str = "fp32"  # "fp32" | "bf16" | "fp16": parameters and activations (megatron mapping)
    eval_interval: int = 0  # evaluate every N steps (and after the last); 0: never
    eval_batches: int = 2  # held-out batches per evaluation

    def __post_init__(self):
        _raise_problems(rules.train_problems(self))


@dataclass
class ParallelConfig:
    """The ``parallel`` section: Megatron's pipeline schedule."""

    pp_size: int = 1
    vpp_size: int = 1
    microbatch_group_size: int | None = None  # None: pp_size (Megatron's default)
    tp_size: int = 1  # tensor parallelism: under Megatron's own layers only (mhc-cg megatron)
    sequence_parallel: bool = False  # split the sequence over the tp ranks between the matmuls
    # expert parallelism: the MoE experts split over ep_size ranks, which hold the dense part
    # as data-parallel replicas (Megatron's own layers only: mhc-cg megatron)
    ep_size: int = 1


@dataclass
class GraphConfig:
    """The ``graph`` section: the capture backend and what is captured."""

    backend: str = "auto"  # "auto" | "cuda" | "te" | "tape"
    cuda_graph_scope: list[str] | None = None
    cuda_graph_modules: list[str] | None = None  # megatron-core >= 0.18 spelling of the same

    @property
    def scopes(self) -> list[str]:
        """The scope list as written, under either spelling (the rules report the two
        disagreeing); ``None`` and ``[]`` both mean "nothing captured"."""
        scopes = self.cuda_graph_scope if self.cuda_graph_scope is not None else self.cuda_graph_modules
        return list(scopes or [])

    @property
    def scope_field(self) -> str:
        """The field the scopes were given in (for messages): the older spelling unless only the
        newer was given."""
        if self.cuda_graph_scope is None and self.cuda_graph_modules is not None:
            return "graph.cuda_graph_modules"
        return "graph.cuda_graph_scope"

    def with_scopes(self, scopes) -> "GraphConfig":
        """This section with ``scopes`` in the older spelling (the newer one cleared)."""
        return dataclasses.replace(self, cuda_graph_scope=list(scopes), cuda_graph_modules=None)


@dataclass
class MegatronConfig:
    """The ``megatron`` section: which Megatron-LM ``mhc-cg megatron`` trains its own mHC GPT of."""

    branch: str = "main"  # "main" | "dev": Megatron-LM's branch (a source snapshot or checkout)
    # how Megatron graphs the training step (its cuda_graph_impl): "transformer_engine" (its
    # TECudaGraphHelper, per layer, graph.cuda_graph_modules) | "full_iteration" (dev's
    # FullCudaGraphWrapper: every microbatch's forward and backward in one graph)
    cuda_graph_impl: str = "transformer_engine"
    # the layers' mHC on mhc_cg's fused kernels, in the branch's arithmetic (dev's field
    # use_fused_mhc / --use-fused-mhc; main's layers take it too): false, Megatron's own ops
    use_fused_mhc: bool = False
    # Megatron-LM's own training script ("pretrain_gpt" | "pretrain_hybrid", from the branch's
    # entry snapshot) with the flags of examples/megatron/flags.NAME for each of ``flags``: the
    # model is what Megatron's builders make of them (the model and train sections are not read)
    entry: str | None = None
    flags: list[str] = field(default_factory=list)

    def __post_init__(self):
        _raise_problems(rules.choice_problems(
            ("megatron.branch", self.branch, rules.MEGATRON_BRANCHES),
            ("megatron.cuda_graph_impl", self.cuda_graph_impl, rules.MEGATRON_GRAPH_IMPLS))
            + rules.entry_field_problems(self.entry, self.flags))


@dataclass
class RunConfig:
    """A whole run: the five sections."""

    model: MHCGPTConfig = field(default_factory=MHCGPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    @classmethod
    def from_dict(cls, data: dict | None) -> "RunConfig":
        """Build from a mapping of sections (YAML's shape): unknown sections or fields, values of
        the wrong type and each section's own rules are reported together, one line each naming
        the field and what is allowed. The rules between sections are
        :func:`mhc_cg.config.rules.check`'s."""
        built = cls.build(data)
        _raise_problems(built.problems)
        return built.config

    @classmethod
    def build(cls, data: dict | None) -> "Built":
        """:meth:`from_dict` without raising, so the rules between sections can run too: a field
        that is unknown, of the wrong type or breaks its section's rules is reported and holds its
        default, and is named in ``unknown`` (``section.field``; a bare section name when the whole
        section is lost), so that no later rule reports a consequence of the default."""
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected a mapping of sections, got {type(data).__name__}")
        problems: list[str] = []
        unknown: set[str] = set()
        sections = typing.get_type_hints(cls)
        for key in data:
            if key not in sections:
                problems.append(f"{key}: unknown section{did_you_mean(key, sections)}; "
                                f"allowed: {', '.join(sections)}")
                unknown.update(_misspelt(key, sections, data))
        built = {name: _build_section(name, section_cls,
                                      {} if data.get(name) is None else data[name], problems, unknown)
                 for name, section_cls in sections.items()}
        return Built(cls(**built), problems, frozenset(unknown))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **sections) -> "RunConfig":
        """A copy with whole sections replaced, or fields of them: ``replace(model={"recompute":
        "block"})`` or ``replace(graph=GraphConfig(...))``."""
        changes = {}
        for name, value in sections.items():
            current = getattr(self, name)
            changes[name] = dataclasses.replace(current, **value) if isinstance(value, dict) else value
        return dataclasses.replace(self, **changes)


class Built(typing.NamedTuple):
    """What :meth:`RunConfig.build` makes of a mapping: the config (broken fields at their
    defaults), a line per problem, and the fields whose value is therefore not the user's."""

    config: RunConfig
    problems: list[str]
    unknown: frozenset[str]


# fields a section fills from another when left out: unknown when their source is
_DERIVED = {"model": (("ffn_hidden_size", "hidden_size"), ("moe_ffn_hidden_size", "ffn_hidden_size"))}


def _misspelt(key, allowed, given) -> list[str]:
    """The name ``key`` most likely misspells, when that one was not given itself."""
    close = difflib.get_close_matches(str(key), list(allowed), n=1)
    return [name for name in close if name not in given]


def _build_section(section: str, cls: type, data, problems: list[str], unknown: set[str]):
    """``cls`` from the fields of ``data`` that are known and of the right type, every problem
    appended to ``problems``; a field left at its default because of one is added to ``unknown``."""
    if not isinstance(data, dict):
        problems.append(f"{section}: expected a mapping of fields, got {type(data).__name__}")
        unknown.add(section)
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {}
    for key, value in data.items():
        if section == "model" and key in rules.FOREIGN_RECOMPUTE_FIELDS:
            problems.append(f"model.{key}: not an mhc_cg option: {rules.FOREIGN_RECOMPUTE_FIELDS[key]}")
        elif key not in hints:
            problems.append(f"{section}.{key}: unknown field{did_you_mean(key, hints)}; "
                            f"allowed: {', '.join(hints)}")
            unknown.update(f"{section}.{name}" for name in _misspelt(key, hints, data))
        elif (message := _type_error(value, hints[key])) is not None:
            problems.append(f"{section}.{key}: {message}")
            unknown.add(f"{section}.{key}")
        else:
            fields[key] = value
    return _construct(section, cls, fields, problems, unknown)


def _construct(section: str, cls: type, fields: dict, problems: list[str], unknown: set[str]):
    """``cls(**fields)``; when its own rules refuse it, their lines are reported (not those that
    quote a field already unknown) and it is built again with the fields they name at their
    defaults, silently: what a default breaks then is a consequence, not the user's problem."""
    first = True
    while True:
        unknown |= _filled_from(section, fields, unknown)
        try:
            return cls(**fields)
        except ConfigError as exc:
            if not fields:
                raise  # the defaults break the section's own rules: a bug, not the user's
            named = {name for name in fields
                     if any(line.startswith(f"{section}.{name}:") for line in exc.problems)}
            if first:
                # a left-out field filled from a refused one would repeat that refusal
                repeats = _filled_from(section, fields, {f"{section}.{n}" for n in named})
                problems.extend(line for line in exc.problems
                                if not rules.mentions_any(line, unknown | repeats))
                first = False
            for name in named or list(fields):
                unknown.add(f"{section}.{name}")
                del fields[name]


def _filled_from(section: str, fields: dict, sources: set[str]) -> set[str]:
    """The fields of ``section`` left out of ``fields`` and so filled from one of ``sources``
    (``section.field``), directly or through another."""
    filled: set[str] = set()
    for name, source in _DERIVED.get(section, ()):
        if fields.get(name) is None and f"{section}.{source}" in sources | filled:
            filled.add(f"{section}.{name}")
    return filled


def _type_error(value, hint) -> str | None:
    """None if ``value`` fits ``hint``, else what was expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = [_type_error(value, a) for a in inner]
        return None if any(e is None for e in errors) else errors[0]
    if origin is list:
        if not isinstance(value, list):
            return f"must be a list, got {value!r}"
        for item in value:
            if (message := _type_error(item, args[0])) is not None:
                return f"list item {item!r}: {message}"
        return None
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"must be a number, got {value!r}"
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"must be an integer, got {value!r}"
    if hint is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if hint is str:
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    return None
