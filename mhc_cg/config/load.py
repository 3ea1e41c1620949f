"""Reading a run config from a YAML file: text, keys and structure, then every rule.

``load_config(path)`` refuses what PyYAML would let through silently (a key given twice, a key
that is not a string, bytes that are not UTF-8) and reports every problem of the file at once,
each on one line naming the field and the fix (:class:`mhc_cg.core.errors.ConfigError`).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from mhc_cg.config.rules import check
from mhc_cg.config.schema import RunConfig
from mhc_cg.core.errors import ConfigError


def load_config(path: str | Path | None) -> RunConfig:
    """Read and check a YAML run config; ``None`` gives the embedded defaults.

    Checks each field (:meth:`RunConfig.from_dict`), then the rules between fields
    (:func:`mhc_cg.config.rules.check`); every problem found is in the one ``ConfigError``.
    """
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
