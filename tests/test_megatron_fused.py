"""Megatron-LM's own mHC GPTs with ``megatron.use_fused_mhc``: every layer's mHC on mhc_cg's fused
kernels (the torch reference on the CPU), main's arithmetic on main, dev's on dev, through the job
``mhc-cg megatron`` runs (one process per rank, Megatron's own TE graph helper, TE's wheel).

* the shipped configs (``configs/megatron_{main,dev}_fused.yaml``, counter dropout 0.1):
  ``--compare --json`` says bit-identical between mhc_cg's static runtime under the layer graphs
  and the fused kernels run eagerly without recompute, counts the fused ops a step ran, and gives
  the largest loss difference against the branch's native run;
* dev's pp 2 x vpp 2 and MoE partial-capture configs with ``use_fused_mhc``: bit-identical on
  every rank.

The kernels' numerics against Megatron's native ops, per gradient, are
``tests/test_megatron_main.py`` and ``tests/test_megatron_dev.py`` (``fused_block_job``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mhc_cg.config import load_config
from megatron_main_oracle import require_snapshot

ROOT = Path(__file__).resolve().parent.parent
# the largest |loss - native loss| allowed: bf16 models whose mHC rounds differently (measured
# <= 8.0e-4 main, 5.4e-4 dev at the shipped shapes, 2.4e-3 at dev's MoE shape; loss ~ 4.2: 1e-3
# of it is a few bf16 ulps)
LOSS_BOUND = 1e-2


def _compare_json(config: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "mhc_cg", "megatron", "--config", config,
                           "--compare", "--json"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("branch", ["main", "dev"])
def test_shipped_fused_config_is_bit_identical_to_the_fused_eager_run(branch):
    require_snapshot(branch)
    result = _compare_json(f"configs/megatron_{branch}_fused.yaml")
    assert result["use_fused_mhc"] is True
    assert result["bit_identical"] is True
    assert result["checked"] == {"mhc_cg": ["mhc_cg_fused_eager"]}
    assert set(result["runs"]) == {f"{branch}_eager_none", "mhc_cg_fused_eager", "mhc_cg"}
    rank = {name: run["ranks"][0] for name, run in result["runs"].items()}
    assert rank[f"{branch}_eager_none"]["fused_op_calls_per_step"] == 0
    for name in ("mhc_cg_fused_eager", "mhc_cg"):
        assert rank[name]["fused_op_calls_per_step"] > 0
        assert rank[name]["fused_kernel_launches_per_step"] >= rank[name]["fused_op_calls_per_step"]
    # 4 layers x 2 microbatches: a pre and a post per sublayer, forward and backward, eagerly
    assert rank["mhc_cg_fused_eager"]["fused_op_calls_per_step"] == 4 * 2 * 2 * 5
    assert rank["mhc_cg"]["layer_graph_replays_per_step"] > 0
    assert rank["mhc_cg"]["recompute_graph_replays_per_step"] > 0
    differences = result["largest_loss_difference_vs_native"]
    assert differences["mhc_cg"] == differences["mhc_cg_fused_eager"]
    assert 0 < differences["mhc_cg"] <= LOSS_BOUND  # other rounding than Megatron's, no more


@pytest.mark.parametrize("config", ["megatron_dev_pp2_vpp2", "megatron_dev_moe_partial"])
def test_devs_pipeline_and_moe_partial_capture_with_fused_kernels_are_bit_identical(config):
    """pp 2 x vpp 2 (each rank's chunks share one arena, the persistent sets along its order,
    TE's warm-up walking the same order) and MoE partial capture at ep 2 x pp 2, both with
    ``use_fused_mhc``: mhc_cg's runs equal the fused eager run bit for bit on every rank."""
    require_snapshot("dev")
    from mhc_cg.lab.megatron_harness.child_process import run_megatron_job
    from mhc_cg.lab.megatron_harness.compare import world_size
    from mhc_cg.lab.megatron_harness.runs import checked_runs, compare_ranks, runs_of

    cfg = load_config(ROOT / "configs" / f"{config}.yaml").replace(
        megatron={"use_fused_mhc": True}, train={"device": "cpu"})
    runs = list(runs_of("dev", fused=True))
    per_rank = run_megatron_job({"config": cfg.to_dict(), "runs": runs, "device": "cpu",
                                 "branch": "dev"}, world_size=world_size(cfg), timeout=300)
    result = compare_ranks([r["runs"] for r in per_rank], "dev", checked_runs("dev", fused=True))
    assert result["bit_identical"] is True, result["mismatches"]
    for rank in result["runs"]["mhc_cg"]["ranks"]:
        assert rank["fused_op_calls_per_step"] > 0
        assert rank["layer_graph_replays_per_step"] > 0


def test_layer_cost_counts_fewer_kernels_and_bytes_with_the_fused_kernels():
    """``mhc-cg megatron --layer-cost``: one step of dev's layer on meta tensors, counted at
    dispatch: the fused kernels make fewer kernels and move fewer bytes than dev's native ops
    (attention and MLP alike in both); the native run calls none of mhc_cg's ops."""
    require_snapshot("dev")
    from mhc_cg.lab.megatron_harness.compare import format_layer_cost, layer_cost

    cost = layer_cost(load_config(ROOT / "configs" / "megatron_dev_fused.yaml"))
    native, fused = cost["native"], cost["fused"]
    assert native["fused_op_kernels"] == 0 < fused["fused_op_kernels"]
    assert fused["kernels"] < native["kernels"] / 4
    bytes_of = {name: r["bytes_read"] + r["bytes_written"] for name, r in cost.items()
                if name in ("native", "fused")}
    assert bytes_of["fused"] < bytes_of["native"]
    assert cost["shape"] == {"seq": 16, "micro_batch": 2, "hidden": 32, "streams": 4,
                             "dtype": "bfloat16"}
    assert f"{native['kernels'] - fused['kernels']} kernels" in format_layer_cost(cost)


def test_shape_without_layer_cost_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "mhc_cg", "megatron", "--config",
                           "configs/megatron_dev_fused.yaml", "--shape", "configs/bench_h100.yaml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--shape is for --layer-cost" in lines[0]
