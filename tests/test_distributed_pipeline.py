"""Pipeline parallelism across processes: megatron-core's schedule on pp ranks (gloo on CPU).

Each run spawns ``pp_size`` processes; every rank runs megatron-core's interleaved 1F1B schedule
with real p2p sends of the residual stream and its chunks on the static runtime. Losses and every
parameter's gradient must equal the same config on one process (``pp_size: 1``) bit for bit, the
gradient norms up to fp32 rounding (summed over ranks, as Megatron does); each rank must use
exactly the planner's persistent slot sets.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from mhc_cg.cli import main
from mhc_cg.config import RunConfig, load_config
from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.pipeline.driver import train_pipeline
from mhc_cg.core.pipeline_order import max_persistent_slot_sets, recomputes_kept
from mhc_cg.lab.compare.pipeline import norms_agree, single_process_config
from mhc_cg.core.pipeline_order import pipeline_order
from mhc_cg.lab.resolve import train_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STEPS = 2


def single_process_run(cfg):
    grads = []
    result = train_config(single_process_config(cfg), steps=STEPS, progress=False,
                   after_backward=lambda step, model: grads.append(
                       {n: p.grad.clone() for n, p in model.named_parameters()
                        if p.grad is not None}))
    return result, grads


def check_against_single_process(cfg, result):
    reference, ref_grads = single_process_run(cfg)
    assert result.losses == reference.losses
    assert norms_agree(result.grad_norms, reference.grad_norms)
    assert result.grad_norms != [0.0] * STEPS
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
        # every block recompute of every step replayed a captured graph, but a chunk's last
        # block's where its backward directly follows its forward (the arena still holds it)
        blocks = cfg.model.num_layers // (par.pp_size * par.vpp_size) // cfg.model.recompute_layers
        kept = STEPS * recomputes_kept(order)
        assert rank["recomputes_eager"] == 0
        assert rank["recomputes_kept"] == kept
        assert rank["recomputes_replayed"] + kept == \
            STEPS * par.vpp_size * cfg.train.num_microbatches * blocks
        # graphed sublayers: a forward and a backward graph per (chunk, microbatch, sublayer),
        # each replayed once per step
        graphed = sum(scope in cfg.graph.cuda_graph_scope for scope in ("attn", "mlp"))
        per_rank = 2 * par.vpp_size * cfg.train.num_microbatches * graphed * (
            cfg.model.num_layers // (par.pp_size * par.vpp_size))
        assert rank["sublayer_graphs"] == per_rank
        assert rank["sublayer_graph_replays"] == STEPS * per_rank


@pytest.fixture(scope="module")
def pp2_run():
    cfg = load_config(CONFIGS / "tiny_pp2_vpp2.yaml")
    return cfg, train_pipeline(cfg, steps=STEPS, progress=False, collect_grads=True)


def test_pp2_vpp2_equals_one_process_bit_for_bit(pp2_run):
    """With attention and MLP sublayers graphed per (chunk, microbatch, layer) as well."""
    cfg, result = pp2_run
    assert (cfg.parallel.pp_size, cfg.parallel.vpp_size) == (2, 2)
    assert set(cfg.graph.cuda_graph_scope) == {"attn", "mlp", "mhc_recompute"}
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


def recompute_only_config_data(num_microbatches: int) -> dict:
    data = yaml.safe_load((CONFIGS / "tiny_pp2_vpp2.yaml").read_text())
    data["train"]["num_microbatches"] = num_microbatches
    data["graph"]["cuda_graph_scope"] = ["mhc_recompute"]  # capture cost does not grow with M
    return data


def test_cli_json_arena_and_sets_the_same_for_4_and_16_microbatches(tmp_path, capsys):
    """``mhc-cg train`` spawns the ranks; 16 microbatches instead of 4: same arena, same sets."""
    cfg_m4 = RunConfig.from_dict(recompute_only_config_data(4))
    m4 = train_pipeline(cfg_m4, steps=1, progress=False)
    path = tmp_path / "m16.yaml"
    path.write_text(yaml.safe_dump(recompute_only_config_data(16)))
    assert main(["train", "--config", str(path), "--steps", "1", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "graphed_static" and out["pp_size"] == 2 and out["vpp_size"] == 2
    assert out["num_microbatches"] == 16
    assert len(out["losses"]) == len(out["grad_norms"]) == 1
    for r4, r16 in zip(m4.ranks, out["ranks"]):
        assert r16["arena_bytes"] == r4["arena_bytes"] > 0
        assert r16["persistent_bytes_per_set"] == r4["persistent_bytes_per_set"]
        # peak in flight is warm-up + 1 for both: the sets do not grow with M either
        assert r16["persistent_sets"] == r4["persistent_sets"] == r16["peak_sets_in_use"]
        assert r16["assignment_matches_planner"]


def test_pipeline_refusals_name_the_field_and_fix():
    cfg = load_config(CONFIGS / "tiny_pp2_vpp2.yaml")
    with pytest.raises(ConfigError, match="--mode: .*graphed_static, got 'eager_none'"):
        train_pipeline(cfg, steps=1, progress=False, mode="eager_none")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute_activation=True))
    with pytest.raises(ConfigError, match="model.recompute_activation: a graphed 'mlp' sublayer"):
        train_pipeline(cfg, steps=1, progress=False)
