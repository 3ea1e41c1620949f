"""Reading a run config from a YAML file: text, keys and structure, then every rule.

``load_config(path)`` refuses what PyYAML would let through silently (a key given twice, a key
that is not a string, bytes that are not UTF-8) and reports every problem of the file at once,
each on one line naming the field and the fix (:class:`mhc_cg.core.errors.ConfigError`).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from mhc_cg.config.rules import check, validate
from mhc_cg.config.schema import RunConfig
from mhc_cg.core.errors import ConfigError


def load_config(path: str | Path | None) -> RunConfig:
    """Read and check a YAML run config; ``None`` gives the embedded defaults.

    Every problem is in the one ``ConfigError``: the keys (:class:`_UniqueKeyLoader`), each field
    and each section's own rules (:meth:`RunConfig.build`), and the rules between sections
    (:func:`mhc_cg.config.rules.validate`), those that do not depend on a field already refused.
    Only text that is not YAML stops at the first problem.
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
        loader = _UniqueKeyLoader(text)  # reads the text for characters YAML refuses
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(path, text, exc)) from None
    if data is None:
        raise ConfigError(f"config: {path} is empty; write at least one section (model, train, "
                          f"parallel, graph), or leave out --config for the built-in defaults")
    built = RunConfig.build(data)
    problems = [*loader.problems, *built.problems, *validate(built.config, built.unknown)]
    if problems:
        raise ConfigError(problems)
    return built.config


def _yaml_error(path: Path, text: str, exc: yaml.YAMLError) -> str:
    """One line: where PyYAML stopped (line and column, from 1), why, and what it was reading."""
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML refuses: an offset, no mark
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - text.rfind("\n", 0, exc.position)
        return (f"config: {path} line {line}, column {column}: character #x{exc.character:04x} is "
                f"not allowed in YAML; remove it")
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return f"config: {path} is not valid YAML: {str(exc).splitlines()[0]}; fix the YAML syntax"
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    where = "" if context is None else f" ({context}" + (
        "" if start is None else f" from line {start.line + 1}, column {start.column + 1}") + ")"
    fix = ("write a plain value there (no tags)" if isinstance(exc, yaml.constructor.ConstructorError)
           else "fix the YAML syntax there")
    return f"config: {path} line {mark.line + 1}, column {mark.column + 1}: {problem}{where}; {fix}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reports a key given twice in one mapping (PyYAML keeps the last
    silently) and keys that are not strings, in ``problems``, and reads on: the last of the keys
    given twice is kept, a key that is not a string is left out."""

    def __init__(self, stream):
        super().__init__(stream)
        self.problems: list[str] = []


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    seen: dict = {}
    kept = []
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            loader.problems.append(f"config: line {line}: key {key!r} is a {type(key).__name__}, "
                                   f"not a field name; write section and field names as text")
            continue
        if key in seen:
            loader.problems.append(f"config: line {line}: {key!r} is given twice (first on line "
                                   f"{seen[key]}); keep one")
        else:
            seen[key] = line
        kept.append((key_node, value_node))
    node.value = kept
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)
