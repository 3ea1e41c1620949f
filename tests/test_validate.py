"""`mhc-cg config check`: shipped configs pass; each inconsistent config exits 2 naming field and fix."""

from pathlib import Path

import pytest
import yaml

from mhc_cg.cli import main
from mhc_cg.config import RunConfig, load_config
from mhc_cg.config.rules import validate

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))

DENSE_RECOMPUTE = {"model": {"num_layers": 4, "recompute": "block", "recompute_layers": 2},
                   "graph": {"cuda_graph_scope": ["attn", "mhc_recompute"]}}


def merged(base: dict, **sections) -> dict:
    out = {name: dict(fields) for name, fields in base.items()}
    for name, fields in sections.items():
        out.setdefault(name, {}).update(fields)
    return out


def check(tmp_path, capsys, data: dict) -> tuple[int, list[str]]:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    rc = main(["config", "check", str(path)])
    return rc, capsys.readouterr().err.strip().splitlines()


def test_shipped_configs_are_listed():
    names = {p.name for p in CONFIGS}
    assert {"tiny_cpu.yaml", "gpt_mhc_pp4_vpp2.yaml", "moe_partial_capture.yaml",
            "bench_h100.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_passes_and_prints_a_config_that_loads_back_equal(path, tmp_path, capsys):
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ok: mode ")
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(out)
    assert load_config(resolved) == load_config(path)


def test_tiny_cpu_keeps_the_readme_defaults():
    cfg = load_config(CONFIGS[0].parent / "tiny_cpu.yaml")
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_streams, m.recompute_layers) == (64, 4, 4, 2)
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.device) == (80, 16, "auto")


def test_bench_h100_shape():
    cfg = load_config(CONFIGS[0].parent / "bench_h100.yaml")
    m, t = cfg.model, cfg.train
    assert (m.num_layers, m.hidden_size, m.num_heads, m.seq_length, m.num_streams) == (8, 2048, 16, 2048, 4)
    assert (t.micro_batch_size, t.dtype) == (2, "bf16")


def test_defaults_are_valid():
    assert validate(RunConfig()) == []


def test_unknown_scope_suggests_the_closest(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, graph={"cuda_graph_scope": ["atn", "mhc_recompute"]}))
    assert rc == 2
    assert err == ["mhc-cg config: error: graph.cuda_graph_scope: unknown scope 'atn' (did you mean "
                   "'attn'?); allowed: attn, mlp, moe, moe_router, moe_preprocess, mhc_recompute"]


def test_unknown_scope_under_the_new_spelling_names_that_field(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, graph={
        "cuda_graph_scope": None, "cuda_graph_modules": ["attn", "mhc_recompte"]}))
    assert rc == 2
    assert "graph.cuda_graph_modules: unknown scope 'mhc_recompte' (did you mean 'mhc_recompute'?)" in err[0]


def test_mhc_recompute_without_mhc(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, model={"num_streams": 1}))
    assert rc == 2 and len(err) == 1
    assert "'mhc_recompute' recomputes the mHC ops, but mHC is off (model.num_streams is 1)" in err[0]
    assert "set model.num_streams >= 2" in err[0]


def test_mhc_recompute_without_block_recompute(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, model={"recompute": "none"}))
    assert rc == 2 and len(err) == 1
    assert "model.recompute is 'none'; set model.recompute: block or remove 'mhc_recompute'" in err[0]


def test_moe_scopes_on_a_dense_model(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, graph={
        "cuda_graph_scope": ["attn", "moe_router", "mhc_recompute"]}))
    assert rc == 2 and len(err) == 1
    assert "['moe_router'] capture MoE layers, but the model is dense (model.num_experts is null)" in err[0]


def test_mlp_scope_on_a_moe_model(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, model={"num_experts": 4}, graph={
        "cuda_graph_scope": ["attn", "mlp", "mhc_recompute"]}))
    assert rc == 2 and len(err) == 1
    assert "'mlp' captures a dense MLP, but every layer's MLP is MoE" in err[0]


def test_moe_preprocess_needs_moe_router(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, model={"num_experts": 4}, graph={
        "cuda_graph_scope": ["attn", "moe_preprocess", "mhc_recompute"]}))
    assert rc == 2 and len(err) == 1
    assert "'moe_preprocess' continues the router's graph, so it needs 'moe_router' too" in err[0]


def test_moe_with_moe_router(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, model={"num_experts": 4}, graph={
        "cuda_graph_scope": ["moe", "moe_router"]}))
    assert rc == 2 and len(err) == 1
    assert "'moe' captures the whole MoE layer, router included, so it cannot be combined with " \
           "'moe_router'" in err[0]


def test_whole_moe_scope_is_refused_for_mhc_cgs_dynamic_dispatch(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, model={"num_experts": 4}, graph={
        "cuda_graph_scope": ["attn", "moe", "mhc_recompute"]}))
    assert rc == 2 and len(err) == 1
    assert "data-dependent shapes" in err[0] and "use 'moe_router'" in err[0]


def test_graphed_recompute_with_stateful_dropout_says_why(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, model={"dropout_impl": "torch"}))
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("mhc-cg config: error: model.dropout_impl: 'torch'")
    assert "cannot rewind" in err[0]
    assert "set model.dropout_impl: counter" in err[0]


def test_stateful_dropout_is_fine_without_dropout_or_eagerly(tmp_path, capsys):
    no_dropout = merged(DENSE_RECOMPUTE, model={"dropout_impl": "torch", "hidden_dropout": 0.0})
    eager = merged(DENSE_RECOMPUTE, model={"dropout_impl": "torch"}, graph={"cuda_graph_scope": ["attn"]})
    assert check(tmp_path, capsys, no_dropout) == (0, [])
    assert check(tmp_path, capsys, eager) == (0, [])


PIPELINE = merged(DENSE_RECOMPUTE, model={"num_layers": 16},
                  parallel={"pp_size": 4, "vpp_size": 2}, train={"num_microbatches": 8})


def test_pipeline_baseline_is_valid(tmp_path, capsys):
    assert check(tmp_path, capsys, PIPELINE) == (0, [])


def test_interleaving_needs_at_least_pp_microbatches(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(PIPELINE, train={"num_microbatches": 2}))
    assert rc == 2 and len(err) == 1
    assert "parallel.microbatch_group_size: must be in [pp_size=4, num_microbatches=2] with " \
           "vpp_size > 1, got 4 (the default is pp_size)" in err[0]


def test_interleaving_needs_microbatches_a_multiple_of_pp_unless_a_group_size_fits(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(PIPELINE, train={"num_microbatches": 10}))
    assert rc == 2 and len(err) == 1
    assert "train.num_microbatches: 10 % microbatch_group_size=4 = 2" in err[0]
    fixed = merged(PIPELINE, train={"num_microbatches": 10}, parallel={"microbatch_group_size": 5})
    assert check(tmp_path, capsys, fixed) == (0, [])


@pytest.mark.parametrize("group", [3, 9])
def test_group_size_between_pp_and_microbatches(tmp_path, capsys, group):
    rc, err = check(tmp_path, capsys, merged(PIPELINE, parallel={"microbatch_group_size": group}))
    assert rc == 2 and len(err) == 1
    assert f"parallel.microbatch_group_size: must be in [pp_size=4, num_microbatches=8] with " \
           f"vpp_size > 1, got {group}" in err[0]


def test_vpp_without_pp(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(PIPELINE, parallel={"pp_size": 1}))
    assert rc == 2 and "parallel.vpp_size: 2 chunks per rank need pp_size > 1" in err[0]


def test_layers_divisible_by_pp_times_vpp(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(PIPELINE, model={"num_layers": 12}))
    assert rc == 2 and len(err) == 1
    assert "model.num_layers: 12 layers cannot be split into pp_size * vpp_size = 8 equal model " \
           "chunks; use a multiple of 8" in err[0]


def test_recompute_block_must_not_cross_a_pipeline_stage(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(PIPELINE, model={"num_layers": 24, "recompute_layers": 2}))
    assert rc == 2 and len(err) == 1
    assert "model.recompute_layers: a recompute block of 2 layers would cross a pipeline stage " \
           "(each model chunk holds num_layers / (pp_size * vpp_size) = 3 layers); use one of " \
           "[1, 3]" in err[0]
    # Without pipeline stages the last block is just shorter.
    single = merged(DENSE_RECOMPUTE, model={"num_layers": 3, "recompute_layers": 2})
    assert check(tmp_path, capsys, single) == (0, [])


def test_scope_and_modules_disagreeing(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, graph={
        "cuda_graph_modules": ["attn", "mlp", "mhc_recompute"]}))
    assert rc == 2 and len(err) == 1
    assert "graph.cuda_graph_modules: ['attn', 'mlp', 'mhc_recompute'] disagrees with " \
           "graph.cuda_graph_scope ['attn', 'mhc_recompute']" in err[0]
    agreeing = merged(DENSE_RECOMPUTE, graph={"cuda_graph_modules": ["mhc_recompute", "attn"]})
    assert check(tmp_path, capsys, agreeing) == (0, [])


def test_cuda_backend_on_a_cpu_device(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, graph={"backend": "cuda"},
                                             train={"device": "cpu"}))
    assert rc == 2 and "graph.backend: 'cuda' captures torch.cuda.CUDAGraph, but train.device is 'cpu'" in err[0]


def test_unknown_backend_suggests(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(DENSE_RECOMPUTE, graph={"backend": "tapes"}))
    assert rc == 2 and "graph.backend: must be one of ['auto', 'cuda', 'te', 'tape'], got 'tapes' " \
                       "(did you mean 'tape'?)" in err[0]


def test_several_problems_are_reported_together(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, merged(PIPELINE, model={
        "num_layers": 12, "recompute": "none", "dropout_impl": "torch"}, graph={
        "cuda_graph_scope": ["atn", "moe_preprocess", "mhc_recompute"]}))
    assert rc == 2
    fields = [line.removeprefix("mhc-cg config: error: ").split(":")[0] for line in err]
    assert sorted(fields) == ["graph.cuda_graph_scope"] * 4 + ["model.dropout_impl", "model.num_layers"]
    assert any("unknown scope 'atn'" in line for line in err)
    assert any("needs 'moe_router' too" in line for line in err)


def test_every_command_that_loads_a_config_validates_it(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(merged(DENSE_RECOMPUTE, model={"recompute": "none"})))
    for argv in (["train", "--config", str(path), "--steps", "1"], ["memory", "--config", str(path)],
                 ["schedule", "--config", str(path)]):
        assert main(argv) == 2
        assert "set model.recompute: block" in capsys.readouterr().err


def test_bad_dtype_and_missing_action(tmp_path, capsys):
    rc, err = check(tmp_path, capsys, {"train": {"dtype": "bf61"}})
    assert rc == 2 and "train.dtype: must be one of ['fp32', 'bf16', 'fp16'], got 'bf61'" in err[0]
    with pytest.raises(SystemExit):
        main(["config"])
