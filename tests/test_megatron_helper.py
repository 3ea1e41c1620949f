"""megatron-core's TECudaGraphHelper drives mhc_cg's static runtime, on the CPU (tape graphs through
the TransformerEngine stand-in in ``mhc_cg/lab/megatron_harness/te_on_tape``).

* Megatron-LM main (the snapshot; ``tests/megatron_main_oracle.py``): main's GPT of
  ``HyperConnectionTransformerLayer``s, trained with megatron's ``forward_backward_func`` under
  main's own helper with ``cuda_graph_modules: [attn, mhc_recompute]``, beside main eagerly
  without recompute, with its ``[mhc]`` recompute, and under its helper with ``[mhc]``;
* megatron-core 0.16.1 (pinned) with our own mHC layer, beside it eagerly without recompute and
  with eager block recompute (counter dropout 0.1);
* ``mhc-cg megatron --compare --json`` on the shipped config, and its errors.

One child process per megatron computes every shape.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_main_oracle import extracted_snapshot, run_job
from megatron_integration.capture.te_graph_helper import RecomputeGraphKey, recompute_capture_order

ROOT = Path(__file__).resolve().parent.parent
# (layers, layers per recompute block, microbatches): a partial last block, blocks of one layer;
# two blocks of two is the shipped config (test_cli_compare_json_on_the_shipped_config), and
# tests/test_megatron_scale.py runs more shapes across ranks
SHAPES = [dict(num_layers=3, recompute_layers=2, num_microbatches=2, steps=3),
          dict(num_layers=4, recompute_layers=1, num_microbatches=1, steps=3)]
IDS = [f"L{s['num_layers']}-Lr{s['recompute_layers']}-M{s['num_microbatches']}" for s in SHAPES]


@pytest.fixture(scope="module")
def main_snapshot(tmp_path_factory):
    return extracted_snapshot("main", tmp_path_factory)


@pytest.fixture(scope="module")
def main_cases(main_snapshot):
    result = run_job(main_snapshot, "main_helper", shapes=SHAPES)
    assert "megatron-lm-main" in result["megatron_core"]
    return result["cases"]


@pytest.fixture(scope="module")
def core_cases():
    result = run_job(None, "core_helper", shapes=SHAPES)
    assert "site-packages" in result["megatron_core"]  # the pinned release, not main
    return result["cases"]


def _blocks(shape) -> int:
    return math.ceil(shape["num_layers"] / shape["recompute_layers"])


def _assert_same_training(ours, reference, what):
    assert ours["losses"] == reference["losses"], what
    assert ours["grad_digests"] == reference["grad_digests"], what  # every gradient byte, every step


def _assert_graphs_replayed(run, shape):
    layers, microbatches = shape["num_layers"], shape["num_microbatches"]
    # every layer's forward and backward graph, once per microbatch
    assert run["layer_graph_replays_per_step"] == 2 * layers * microbatches
    # every recompute block's graph, by its hook, once per microbatch, but the last block's: one
    # rank, so each backward directly follows its forward, which left that block in the arena
    last = layers - (_blocks(shape) - 1) * shape["recompute_layers"]
    assert run["recompute_graph_replays_per_step"] == (_blocks(shape) - 1) * microbatches
    assert run["recompute_blocks_kept_per_step"] == microbatches
    assert run["recomputed_sublayers_per_step"] == 2 * (layers - last) * microbatches
    assert run["kept_sublayers_per_step"] == 2 * last * microbatches


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=IDS)
def test_megatron_main_under_its_helper_is_bit_identical_to_main(main_cases, index):
    case = main_cases[index]
    runs = case["runs"]
    assert case["bit_identical"] is True and case["mismatches"] == []
    for reference in ("main_eager_none", "main_eager_mhc", "main_graphed_mhc"):
        _assert_same_training(runs["mhc_cg"], runs[reference], reference)
    _assert_graphs_replayed(runs["mhc_cg"], case["shape"])


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=IDS)
def test_every_mhc_checkpoint_main_registers_eagerly_is_recomputed_under_graphs(main_cases, index):
    """Main checkpoints 6 ops per layer of a block less the block end's MLP bias-dropout-add;
    under its helper only the MLP side's 3 per layer (the attention side runs in the graph,
    where no recompute manager reaches it). mhc_cg recomputes every sublayer under graphs, or
    finds it still in the arena."""
    case = main_cases[index]
    shape, runs = case["shape"], case["runs"]
    layers, microbatches = shape["num_layers"], shape["num_microbatches"]
    blocks = _blocks(shape)
    assert runs["main_eager_mhc"]["mhc_checkpoints_per_step"] == (6 * layers - blocks) * microbatches
    assert runs["main_graphed_mhc"]["mhc_checkpoints_per_step"] == (3 * layers - blocks) * microbatches
    assert runs["main_graphed_mhc"]["recompute_graph_replays_per_step"] == 0
    assert runs["mhc_cg"]["mhc_checkpoints_per_step"] == 0
    assert runs["mhc_cg"]["recomputed_sublayers_per_step"] \
        + runs["mhc_cg"]["kept_sublayers_per_step"] == 2 * layers * microbatches


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=IDS)
def test_megatron_main_saved_bytes_nothing_silently_kept(main_cases, index):
    runs = main_cases[index]["runs"]
    saved = {name: run["saved_bytes_per_layer"] for name, run in runs.items()}
    print(f"\n{IDS[index]} saved bytes per layer: {saved}; mhc_cg arena "
          f"{runs['mhc_cg']['arena_bytes']} B per rank")
    assert saved["mhc_cg"] <= saved["main_eager_mhc"] < saved["main_eager_none"]
    assert saved["mhc_cg"] < saved["main_graphed_mhc"]
    assert runs["mhc_cg"]["arena_bytes"] > 0


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=IDS)
def test_megatron_core_0_16_helper_with_our_layer_is_bit_identical(core_cases, index):
    case = core_cases[index]
    shape, runs = case["shape"], case["runs"]
    ours = runs["mhc_cg"]
    for reference in ("core_eager_none", "core_eager_block"):
        _assert_same_training(ours, runs[reference], reference)
    _assert_graphs_replayed(ours, shape)
    # each layer graph is the mHC sublayer on the n*C stream: [seq, mbs, 4 streams x hidden 32]
    assert ours["graph_inputs"] == [[16, 2, 4 * 32]] * shape["num_layers"]
    # captured along the helper's order (pp 1: one forward, one backward), last block first
    assert ours["order"] == [1, -1]
    expected = recompute_capture_order(ours["order"], shape["num_layers"], shape["recompute_layers"])
    assert [RecomputeGraphKey(*key) for key in ours["recompute_graphs"]] == expected
    saved = {name: run["saved_bytes_per_layer"] for name, run in runs.items()}
    assert saved["mhc_cg"] <= saved["core_eager_block"] < saved["core_eager_none"]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mhc_cg", "megatron", *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=600)


def test_cli_compare_json_on_the_shipped_config(main_snapshot):
    proc = _cli("--config", "configs/megatron_main_mhc.yaml", "--compare", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert set(result) == {"bit_identical", "runs", "checked", "capturing_function", "cpu_changes",
                           "use_fused_mhc", "largest_loss_difference_vs_native"}
    assert result["use_fused_mhc"] is False
    # a CPU run turns off the fusions whose kernels need CUDA, and says so with the reasons
    assert result["cpu_changes"]["masked_softmax_fusion"].startswith("False (")
    assert result["bit_identical"] is True
    # megatron's helper called TE's own function, from its wheel
    assert result["capturing_function"]["file"].endswith(".whl/transformer_engine/pytorch/graph.py")
    assert result["capturing_function"]["te_version"] == "2.20.2"
    assert result["checked"]["mhc_cg"] == ["main_eager_none", "main_eager_mhc"]
    assert set(result["runs"]) == {"main_eager_none", "main_eager_mhc", "main_graphed_mhc", "mhc_cg"}
    assert all(set(run) == {"losses", "ranks"} and len(run["ranks"]) == 1
               for run in result["runs"].values())
    rank = {name: run["ranks"][0] for name, run in result["runs"].items()}
    assert set(rank["mhc_cg"]) == {"rank", "pp_rank", "tp_rank", "ep_rank", "saved_bytes_per_layer",
                                   "persistent_slot_sets", "arena_bytes",
                                   "layer_graph_replays_per_step",
                                   "recompute_graph_replays_per_step",
                                   "recompute_blocks_kept_per_step", "fused_op_calls_per_step",
                                   "fused_kernel_launches_per_step"}
    ours = rank["mhc_cg"]
    assert ours["fused_op_calls_per_step"] == 0  # main's own ops, stepwise
    assert ours["layer_graph_replays_per_step"] > 0 and ours["recompute_graph_replays_per_step"] > 0
    assert ours["persistent_slot_sets"] == 1 and ours["arena_bytes"] > 0
    assert ours["saved_bytes_per_layer"] <= rank["main_eager_mhc"]["saved_bytes_per_layer"]
    assert ours["saved_bytes_per_layer"] < rank["main_graphed_mhc"]["saved_bytes_per_layer"]
    assert "[mhc-cg megatron] mhc_cg: step 4/4" in proc.stderr  # progress on stderr


def test_cli_says_what_is_missing_when_main_is_not_found(tmp_path):
    env = {"MHC_CG_THIRD_PARTY": str(tmp_path), "MHC_CG_MEGATRON_LM": ""}
    proc = _cli("--config", "configs/megatron_main_mhc.yaml", env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "Megatron-LM main's megatron.core" in lines[0] and "set MHC_CG_MEGATRON_LM" in lines[0]


def test_cli_refuses_what_the_megatron_path_cannot_run(tmp_path, capsys):
    from mhc_cg.cli import main

    config = tmp_path / "bad.yaml"
    config.write_text("model: {recompute: block, hidden_dropout: 0.1, dropout_impl: torch}\n"
                      "graph: {backend: te, cuda_graph_modules: [attn, mhc_recompute]}\n")
    proc = _cli("--config", str(config))
    # torch's stateful dropout: one line naming the setting that fixes it
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mhc-cg megatron: error: model.dropout_impl:")
    assert "set model.dropout_impl: counter" in lines[0]
    config.write_text("model: {recompute: block, hidden_dropout: 0.1}\ntrain: {dtype: fp32}\n"
                      "parallel: {pp_size: 2}\n"
                      "graph: {backend: te, cuda_graph_modules: [mlp, mhc_recompute]}\n")
    assert main(["megatron", "--config", str(config)]) == 2  # in process: the same main
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    for field in ("train.dtype", "parallel.pp_size", "graph.cuda_graph_modules"):
        assert any(line.startswith(f"mhc-cg megatron: error: {field}:") and " set " in line
                   for line in stderr.splitlines()), field


def test_main_layer_with_counter_dropout_is_bit_identical_to_main(main_snapshot):
    """``hidden_dropout: 0.1`` in main's own layers, opted into counter dropout
    (``use_counter_dropout``, ``model.dropout_impl: counter``): main's eager run, main's own
    ``[mhc]`` recompute and mhc_cg's layer and recompute graphs draw the same masks, bit for
    bit."""
    from mhc_cg.lab.megatron_harness.child_process import run_megatron_job
    from mhc_cg.lab.megatron_harness.runs import compare_ranks
    from mhc_cg.config import load_config

    cfg = load_config(ROOT / "configs/megatron_main_mhc.yaml").replace(
        model={"hidden_dropout": 0.1, "dropout_impl": "counter"}, train={"device": "cpu"})
    per_rank = run_megatron_job({"config": cfg.to_dict(),
                                 "runs": ["main_eager_none", "main_eager_mhc", "mhc_cg"],
                                 "device": "cpu", "branch": "main"}, timeout=300)
    result = compare_ranks([r["runs"] for r in per_rank], "main")
    assert result["bit_identical"] is True, result["mismatches"]
    runs = result["runs"]
    assert runs["mhc_cg"]["ranks"][0]["recompute_graph_replays_per_step"] > 0
    # dropout is on: the losses are not the dropout-free run's
    free = compare_ranks([r["runs"] for r in run_megatron_job(
        {"config": cfg.replace(model={"hidden_dropout": 0.0}).to_dict(), "runs": ["mhc_cg"],
         "device": "cpu", "branch": "main"}, timeout=300)], "main")
    assert free["runs"]["mhc_cg"]["losses"] != runs["mhc_cg"]["losses"]
