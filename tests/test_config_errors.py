"""`mhc-cg config check` reports every problem of a file in one run: the keys, each field, each
section's own rules and the rules between sections, together; a stand-in default for a refused
field never produces a second line; YAML that does not parse names its line and column."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mhc_cg.cli import main
from mhc_cg.config import RunConfig, load_config
from mhc_cg.core.errors import ConfigError

PREFIX = "mhc-cg config: error: "
DOC = Path(__file__).parent.parent / "docs" / "configuration.md"


def config_check(tmp_path, capsys, text: str | bytes) -> list[str]:
    """The error lines of ``mhc-cg config check`` on ``text`` (which must fail, exit status 2)."""
    path = tmp_path / "run.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    assert main(["config", "check", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and lines and all(line.startswith(PREFIX) for line in lines), lines
    assert not any("Traceback" in line for line in lines)
    return [line.removeprefix(PREFIX) for line in lines]


def fields(lines: list[str]) -> list[str]:
    return [line.split(":")[0] for line in lines]


def test_unknown_field_invalid_value_and_a_rule_between_fields_print_together(tmp_path, capsys):
    lines = config_check(tmp_path, capsys, "model:\n  hiden_size: 64\n  hidden_size: 64\n"
                                           "  num_heads: 5\ntrain:\n  dtype: fp8\n")
    assert fields(lines) == ["model.hiden_size", "model.num_heads", "train.dtype"]
    assert "unknown field (did you mean 'hidden_size'?)" in lines[0]
    assert "must divide hidden_size=64, got 5" in lines[1]
    assert "must be one of ['fp32', 'bf16', 'fp16'], got 'fp8'" in lines[2]


def test_a_section_refused_does_not_hide_the_rules_between_sections(tmp_path, capsys):
    lines = config_check(tmp_path, capsys, "model: {num_heads: 5, hidden_size: 64}\n"
                                           "graph: {cuda_graph_scope: [attn, mhc_recompte]}\n")
    assert fields(lines) == ["model.num_heads", "graph.cuda_graph_scope"]
    assert "unknown scope 'mhc_recompte' (did you mean 'mhc_recompute'?)" in lines[1]


@pytest.mark.parametrize("model", ["[1, 2]", "{hidden_size: '64'}", "{kernels: cuda}"])
def test_every_section_is_checked_whatever_another_holds(tmp_path, capsys, model):
    lines = config_check(tmp_path, capsys, f"model: {model}\ntrain: {{steps: 0}}\n"
                                           f"parallel: {{vpp_size: 2}}\n")
    assert fields(lines)[1:] == ["train.steps", "parallel.vpp_size"], lines
    assert "need pp_size > 1" in lines[2]


def test_key_problems_come_with_the_rest(tmp_path, capsys):
    lines = config_check(tmp_path, capsys, "model:\n  1: 2\n  num_heads: 5\n  num_heads: 3\n"
                                           "graph: {cuda_graph_scope: [atn]}\n")
    assert lines[0] == ("config: line 2: key 1 is a int, not a field name; write section and "
                        "field names as text")
    assert lines[1] == "config: line 4: 'num_heads' is given twice (first on line 3); keep one"
    assert fields(lines)[2:] == ["model.num_heads", "graph.cuda_graph_scope"]
    assert "got 3" in lines[2]  # the last of the two, as YAML reads it


def test_a_rule_that_needs_a_refused_field_is_skipped(tmp_path, capsys):
    # model.recompute is refused and stands at its default, 'none': the scope rule that
    # mhc_recompute needs block recompute would only repeat that
    lines = config_check(tmp_path, capsys, "model: {recompute: blok}\n"
                                           "graph: {cuda_graph_scope: [attn, mhc_recompute]}\n")
    assert fields(lines) == ["model.recompute"]


def test_a_misspelt_field_stands_for_the_one_it_misspells(tmp_path, capsys):
    # num_heads 5 would not divide the default hidden size, but the hidden size meant is unknown
    lines = config_check(tmp_path, capsys, "model: {hiden_size: 48, num_heads: 5}\n")
    assert fields(lines) == ["model.hiden_size"]
    # a misspelt section likewise: the mhc_recompute rules would judge the default model
    lines = config_check(tmp_path, capsys, "modle: {recompute: block}\n"
                                           "graph: {cuda_graph_scope: [attn, mhc_recompute]}\n")
    assert fields(lines) == ["modle"]


def test_a_field_filled_from_a_refused_one_is_not_refused_again(tmp_path, capsys):
    # ffn_hidden_size and moe_ffn_hidden_size default to 4 * hidden_size: one problem, one line
    lines = config_check(tmp_path, capsys, "model: {hidden_size: 0}\nparallel: {tp_size: 3}\n")
    assert fields(lines) == ["model.hidden_size", "model.num_heads", "model.vocab_size"]
    assert "does not split over parallel.tp_size=3" in lines[1]


def test_rules_within_the_model_section_are_not_staged(tmp_path, capsys):
    lines = config_check(tmp_path, capsys, "model: {kernels: cuda, recompute_activation: true, "
                                           "recompute_activation_layers: 9}\n")
    assert fields(lines) == ["model.kernels", "model.recompute_activation_layers"]


@pytest.mark.parametrize("text, where, problem, fix", [
    ("model:\n  num_heads: 4\ntrain: steps: 3\n", "line 3, column 13",
     "mapping values are not allowed here", "fix the YAML syntax there"),
    ("graph: {cuda_graph_scope: [attn\n", "line 2, column 1",
     "expected ',' or ']', but got '<stream end>' (while parsing a flow sequence from line 1, "
     "column 27)", "fix the YAML syntax there"),
    ("model:\n  hidden_size: 64\n\x00", "line 3, column 1",
     "character #x0000 is not allowed in YAML", "remove it"),
    ("model: !!python/object:os.system {}\n", "line 1, column 8",
     "could not determine a constructor", "write a plain value there (no tags)"),
])
def test_yaml_that_does_not_parse_names_line_and_column(tmp_path, capsys, text, where, problem,
                                                        fix):
    [line] = config_check(tmp_path, capsys, text)
    assert line.startswith(f"config: {tmp_path / 'run.yaml'} {where}: ") and problem in line, line
    assert line.endswith(f"; {fix}"), line


def test_from_dict_still_refuses_a_section_and_load_config_lists_everything(tmp_path):
    with pytest.raises(ConfigError) as exc:
        RunConfig.from_dict({"model": {"num_heads": 5}, "graph": {"cuda_graph_scope": ["atn"]}})
    assert [p.split(":")[0] for p in exc.value.problems] == ["model.num_heads"]
    path = tmp_path / "run.yaml"
    path.write_text("model: {num_heads: 5}\ngraph: {cuda_graph_scope: [atn]}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert fields(exc.value.problems) == ["model.num_heads", "graph.cuda_graph_scope"]


def test_the_documented_examples_are_what_config_check_prints(tmp_path, capsys, monkeypatch):
    runs = re.findall(r"this `(\w+\.yaml)`:\n\n```yaml\n(.*?)```\n\n```\n"
                      r"\$ mhc-cg config check \1 +# exit 2\n(.*?)```", DOC.read_text(), re.S)
    assert [name for name, _, _ in runs] == ["bad.yaml", "typo.yaml"]
    monkeypatch.chdir(tmp_path)
    for name, text, printed in runs:
        Path(name).write_text(text)
        assert main(["config", "check", name]) == 2
        assert capsys.readouterr().err.splitlines() == printed.splitlines(), name
