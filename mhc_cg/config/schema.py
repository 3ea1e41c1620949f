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
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mhc_cg.core.dtypes import TRAIN_DTYPES
from mhc_cg.core.errors import ConfigError, did_you_mean
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
    eval_interval: int = 0  # evaluate every N steps (and after the last); 0: never
    eval_batches: int = 2  # held-out batches per evaluation

    def __post_init__(self):
        problems = [f"train.{name}: must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("steps", "micro_batch_size", "num_microbatches", "eval_batches")
                    if getattr(self, name) < 1]
        if self.eval_interval < 0:
            problems.append(f"train.eval_interval: must be >= 0 (0: no evaluation), got "
                            f"{self.eval_interval!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"train.lr: must be a finite number > 0 (e.g. 3e-3), got {self.lr!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            problems.append(f"train.weight_decay: must be a finite number >= 0 (0 turns it off), "
                            f"got {self.weight_decay!r}")
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

    Checks each field, then the rules between fields (``mhc_cg.config.rules``); every problem found
    is in the one ``ConfigError``.
    """
    from mhc_cg.config.rules import check  # validate imports this module's types

    if path is None:
        return check(RunConfig())
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config: {path} is not UTF-8 text (byte {exc.start}: "
                          f"{exc.object[exc.start:exc.start + 1]!r}); save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}; check the path and "
                          f"its permissions") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {path} is not valid YAML: {exc}".splitlines()[0]) from None
    if data is None:
        raise ConfigError(f"config: {path} is empty; write at least one section (model, train, "
                          f"parallel, graph), or leave out --config for the built-in defaults")
    return check(RunConfig.from_dict(data))


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last
    silently) and keys that are not strings."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            raise ConfigError(f"config: line {line}: key {key!r} is a {type(key).__name__}, not a "
                              f"field name; write section and field names as text")
        if key in seen:
            raise ConfigError(f"config: line {line}: {key!r} is given twice (first on line "
                              f"{seen[key]}); keep one")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)


def _build_section(section: str, cls: type, data: dict, problems: list[str]):
    from mhc_cg.config.rules import FOREIGN_RECOMPUTE_FIELDS  # validate imports this module's types

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
