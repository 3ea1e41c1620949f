"""Pipeline parallelism across processes: megatron-core's schedule on pp ranks (gloo on CPU).

Each run spawns ``pp_size`` processes; every rank runs megatron-core's interleaved 1F1B schedule
with real p2p sends of the residual stream and its chunks on the static runtime. Losses, gradient
norms and every parameter's gradient must equal the same config on one process (``pp_size: 1``),
bit for bit; each rank must use exactly the planner's persistent slot sets.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from mhc_cg.cli import main
from mhc_cg.config import load_config
from mhc_cg.errors import ConfigError
from mhc_cg.pipeline.distributed import train_pipeline
from mhc_cg.pipeline.planner import max_persistent_slot_sets
from mhc_cg.pipeline.report import single_process_config
from mhc_cg.pipeline.schedule import pipeline_order
from mhc_cg.train import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STEPS = 2


def single_process_run(cfg):
    grads = []
    result = train(single_process_config(cfg), steps=STEPS, progress=False,
                   after_backward=lambda step, model: grads.append(
                       {n: p.grad.clone() for n, p in model.named_parameters()
                        if p.grad is not None}))
    return result, grads


def check_against_single_process(cfg, result):
    reference, ref_grads = single_process_run(cfg)
    assert result.losses == reference.losses
    assert result.grad_norms == reference.grad_norms
    for step in range(STEPS):
        assert result.grads[step].keys() == ref_grads[step].keys()
        for name, grad in ref_grads[step].items():
            assert torch.equal(result.grads[step][name], grad), (step, name)


def check_planned_sets(cfg, result):
    par = cfg.parallel
    assert len(result.ranks) == par.pp_size
    for rank in result.ranks:
        order = pipeline_order(par.pp_size, rank["rank"], cfg.train.num_microbatches,
                               par.vpp_size, par.microbatch_group_size)
        assert rank["order"] == order
        assert rank["persistent_sets"] == rank["peak_sets_in_use"] == max_persistent_slot_sets(order)
        assert rank["assignment_matches_planner"]
        # every block recompute of every step replayed a captured graph
        blocks = cfg.model.num_layers // (par.pp_size * par.vpp_size) // cfg.model.recompute_layers
        assert rank["recomputes_eager"] == 0
        assert rank["recomputes_replayed"] == STEPS * par.vpp_size * cfg.train.num_microbatches * blocks


@pytest.fixture(scope="module")
def pp2_run():
    cfg = load_config(CONFIGS / "tiny_pp2_vpp2.yaml")
    return cfg, train_pipeline(cfg, steps=STEPS, progress=False, collect_grads=True)


def test_pp2_vpp2_equals_one_process_bit_for_bit(pp2_run):
    cfg, result = pp2_run
    assert (cfg.parallel.pp_size, cfg.parallel.vpp_size) == (2, 2)
    check_against_single_process(cfg, result)


def test_pp2_vpp2_uses_the_planners_persistent_sets(pp2_run):
    cfg, result = pp2_run
    check_planned_sets(cfg, result)
    assert [r["stages"] for r in result.ranks] == [[0, 2], [1, 3]]


def test_pp4_vpp2_equals_one_process_bit_for_bit():
    cfg = load_config(CONFIGS / "tiny_pp4_vpp2.yaml")
    assert (cfg.parallel.pp_size, cfg.parallel.vpp_size) == (4, 2)
    result = train_pipeline(cfg, steps=STEPS, progress=False, collect_grads=True)
    check_against_single_process(cfg, result)
    check_planned_sets(cfg, result)


def test_cli_json_with_16_microbatches_keeps_the_arena(pp2_run, tmp_path, capsys):
    """``mhc-cg train`` spawns the ranks; 16 microbatches instead of 4: same arena, same sets."""
    cfg, result_m4 = pp2_run
    data = yaml.safe_load((CONFIGS / "tiny_pp2_vpp2.yaml").read_text())
    data["train"]["num_microbatches"] = 16
    path = tmp_path / "m16.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", "--config", str(path), "--steps", "1", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "graphed_static" and out["pp_size"] == 2 and out["vpp_size"] == 2
    assert len(out["losses"]) == len(out["grad_norms"]) == 1
    for m4, m16 in zip(result_m4.ranks, out["ranks"]):
        assert m16["arena_bytes"] == m4["arena_bytes"]
        assert m16["persistent_bytes_per_set"] == m4["persistent_bytes_per_set"]
        # peak in flight is warm-up + 1 on both: the sets do not grow with M either
        assert m16["persistent_sets"] == m4["persistent_sets"] == m16["peak_sets_in_use"]
    assert out["losses"][0] != result_m4.losses[0]  # 16 microbatches: another batch, another loss


def test_pipeline_rejects_graphed_sublayers_and_other_modes():
    cfg = load_config(CONFIGS / "tiny_pp2_vpp2.yaml")
    cfg = dataclasses.replace(cfg, graph=dataclasses.replace(
        cfg.graph, cuda_graph_scope=["attn", "mhc_recompute"]))
    with pytest.raises(ConfigError, match=r"graph.cuda_graph_scope: \['attn'\].*use \[mhc_recompute\]"):
        train_pipeline(cfg, steps=1, progress=False)
    with pytest.raises(ConfigError, match="--mode: .*graphed_static, got 'eager_none'"):
        train_pipeline(cfg, steps=1, progress=False, mode="eager_none")
