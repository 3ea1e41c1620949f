"""The typed run configuration that every command reads: YAML -> dataclasses, checked field by field.

A YAML file has up to four sections, each optional::

    model:    MHCGPTConfig fields (shape, dropout, recompute)
    train:    TrainConfig fields (steps, batch, optimiser, device)
    parallel: ParallelConfig fields (pipeline schedule)
    graph:    GraphConfig fields (capture backend and scope)

Unknown sections or fields, and values of the wrong type, are reported together, each on one
line that names the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mhc_cg.dtypes import TRAIN_DTYPES
from mhc_cg.errors import ConfigError, did_you_mean
from mhc_cg.model import MHCGPTConfig

@dataclass
class TrainConfig:
    steps: int = 60
    micro_batch_size: int = 8
    num_microbatches: int = 1  # microbatches per step (gradient accumulation / pipeline depth)
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 1234
    device: str = "cpu"  # "cpu" | "cuda" | "auto"
    dtype: str = "fp32"  # "fp32" | "bf16" | "fp16": parameters and activations (megatron mapping)

    def __post_init__(self):
        problems = [f"train.{name}: must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("steps", "micro_batch_size", "num_microbatches")
                    if getattr(self, name) < 1]
        if self.lr <= 0:
            problems.append(f"train.lr: must be > 0, got {self.lr!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            problems.append(f"train.device: must be one of ['cpu', 'cuda', 'auto'], got {self.device!r}")
        if self.dtype not in TRAIN_DTYPES:
            problems.append(f"train.dtype: must be one of {list(TRAIN_DTYPES)}, got {self.dtype!r}")
        if problems:
            raise ConfigError(problems)


@dataclass
class ParallelConfig:
    pp_size: int = 1
    vpp_size: int = 1
    microbatch_group_size: int | None = None  # None: pp_size (Megatron's default)


@dataclass
class GraphConfig:
    backend: str = "auto"  # "auto" | "cuda" | "te" | "tape"
    cuda_graph_scope: list[str] | None = None
    cuda_graph_modules: list[str] | None = None  # megatron-core >= 0.18 spelling of the same


@dataclass
class RunConfig:
    model: MHCGPTConfig = field(default_factory=MHCGPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)

    @classmethod
    def from_dict(cls, data: dict | None) -> "RunConfig":
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected a mapping of sections, got {type(data).__name__}")
        problems: list[str] = []
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        for key in data:
            if key not in sections:
                problems.append(f"{key}: unknown section{did_you_mean(key, sections)}; "
                                f"allowed: {', '.join(sections)}")
        built = {}
        for name, section_cls in typing.get_type_hints(cls).items():
            section = _build_section(name, section_cls, data.get(name) or {}, problems)
            if section is not None:
                built[name] = section
        if problems:
            raise ConfigError(problems)
        return cls(**built)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None) -> RunConfig:
    """Read and check a YAML run config; ``None`` gives the embedded defaults.

    Checks each field, then the rules between fields (``mhc_cg.validate``); every problem found
    is in the one ``ConfigError``.
    """
    from mhc_cg.validate import check  # validate imports this module's types

    if path is None:
        return check(RunConfig())
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {path} is not valid YAML: {exc}".splitlines()[0]) from exc
    return check(RunConfig.from_dict(data))


def _build_section(section: str, cls: type, data: dict, problems: list[str]):
    from mhc_cg.validate import FOREIGN_RECOMPUTE_FIELDS  # validate imports this module's types

    if not isinstance(data, dict):
        problems.append(f"{section}: expected a mapping of fields, got {type(data).__name__}")
        return None
    hints = typing.get_type_hints(cls)
    ok = True
    for key, value in data.items():
        if section == "model" and key in FOREIGN_RECOMPUTE_FIELDS:
            problems.append(f"model.{key}: not an mhc_cg option: {FOREIGN_RECOMPUTE_FIELDS[key]}")
            ok = False
        elif key not in hints:
            problems.append(f"{section}.{key}: unknown field{did_you_mean(key, hints)}; "
                            f"allowed: {', '.join(hints)}")
            ok = False
        elif (message := _type_error(value, hints[key])) is not None:
            problems.append(f"{section}.{key}: {message}")
            ok = False
    if not ok:
        return None
    try:
        return cls(**data)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None


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
