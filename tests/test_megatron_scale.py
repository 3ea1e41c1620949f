"""Megatron-LM dev's own mHC GPT at scale, under dev's own TE graph helper, on mhc_cg's runtime.

One process per rank (gloo on the CPU; TransformerEngine's graph API on the tape), dev's
``GPTModel`` of ``HyperConnectionTransformerLayer``s trained with megatron-core's
``forward_backward_func``, ``cuda_graph_modules: [attn, mhc_recompute]``:

* ``mhc-cg megatron --compare --json`` on the shipped tp 2 (sequence parallel) x pp 2,
  pp 2 x vpp 2 and MoE partial-capture (pp 2 x ep 2, a dense layer among MoE ones) configs,
  beside dev's own runs: bit-identical to dev without recompute on every rank, every layer graph
  and recompute graph replayed, each rank's persistent slot sets the count ``mhc-cg schedule``
  prints for its pipeline rank, saved bytes per layer at most dev's;
* another layer count, microbatch count and block size through the same job; MoE at EP 1 with
  the graph ending after the router, counter dropout.

The snapshot is ``../shared/third_party/megatron-lm-dev-*.tar.gz``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mhc_cg.config import load_config
from mhc_cg.core.pipeline_order import pipeline_order, recomputes_kept
from megatron_main_oracle import require_snapshot

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"tp2_pp2": "configs/megatron_dev_tp2_pp2.yaml",
           "pp2_vpp2": "configs/megatron_dev_pp2_vpp2.yaml",
           "moe_partial": "configs/megatron_dev_moe_partial.yaml"}
RUNS = ("dev_eager_none", "dev_eager_mhc", "dev_graphed_mhc", "mhc_cg")


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mhc_cg", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def shipped(request):
    require_snapshot("dev")
    path = CONFIGS[request.param]
    proc = _cli("megatron", "--config", path, "--compare", "--json")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return request.param, load_config(ROOT / path), json.loads(proc.stdout), proc.stderr


def _schedule_slot_sets(cfg) -> dict[int, int]:
    p = cfg.parallel
    proc = _cli("schedule", "--pp", str(p.pp_size), "--vpp", str(p.vpp_size), "--microbatches",
                str(cfg.train.num_microbatches), "--json")
    assert proc.returncode == 0, proc.stderr
    return {r["rank"]: r["persistent_slot_sets"] for r in json.loads(proc.stdout)["ranks"]}


def _layers_per_rank(cfg) -> int:
    return cfg.model.num_layers // cfg.parallel.pp_size


def _kept(cfg, pp_rank: int) -> int:
    """Block recomputes a rank skips per step: its backwards right after their own forward."""
    p = cfg.parallel
    return recomputes_kept(pipeline_order(p.pp_size, pp_rank, cfg.train.num_microbatches,
                                          p.vpp_size, p.microbatch_group_size))


def test_shipped_config_is_bit_identical_to_dev_on_every_rank(shipped):
    name, cfg, result, stderr = shipped
    p = cfg.parallel
    assert result["bit_identical"] is True
    assert set(result["runs"]) == set(RUNS)
    ours = result["runs"]["mhc_cg"]
    reference = result["runs"]["dev_eager_none"]
    assert ours["losses"] == reference["losses"] and len(ours["losses"]) == cfg.train.steps
    # megatron's rank order: tensor-parallel ranks first, then data-parallel (= expert-parallel)
    ranks = [(r["pp_rank"], r["ep_rank"], r["tp_rank"]) for r in ours["ranks"]]
    assert ranks == [(pp, ep, tp) for pp in range(p.pp_size) for ep in range(p.ep_size)
                     for tp in range(p.tp_size)]
    blocks_per_chunk = cfg.model.num_layers // (p.pp_size * p.vpp_size) // cfg.model.recompute_layers
    m = cfg.train.num_microbatches
    for rank in ours["ranks"]:
        # every layer graph of the rank, forward and backward, once per microbatch
        assert rank["layer_graph_replays_per_step"] == 2 * _layers_per_rank(cfg) * m
        # every recompute block of every chunk, by its hook, once per microbatch; but a chunk's
        # last block where its backward directly follows its forward (the arena still holds it)
        kept = _kept(cfg, rank["pp_rank"])
        assert rank["recompute_blocks_kept_per_step"] == kept
        assert rank["recompute_graph_replays_per_step"] + kept == blocks_per_chunk * p.vpp_size * m
        assert rank["arena_bytes"] > 0
    assert f"[mhc-cg megatron] mhc_cg: step {cfg.train.steps}/{cfg.train.steps}" in stderr


def test_each_rank_holds_the_slot_sets_its_order_needs(shipped):
    _, cfg, result, _ = shipped
    planned = _schedule_slot_sets(cfg)
    got = {(r["pp_rank"], r["tp_rank"]): r["persistent_slot_sets"]
           for r in result["runs"]["mhc_cg"]["ranks"]}
    print(f"\nslot sets per (pp, tp) rank: {got}; mhc-cg schedule: {planned}")
    assert all(sets == planned[pp] for (pp, _), sets in got.items())
    if cfg.parallel.pp_size > 1:  # the first stage keeps more microbatches in flight
        assert planned[0] > planned[cfg.parallel.pp_size - 1]


def test_saved_bytes_at_most_dev_on_every_rank(shipped):
    name, cfg, result, _ = shipped
    runs = result["runs"]
    for index, ours in enumerate(runs["mhc_cg"]["ranks"]):
        saved = {run: runs[run]["ranks"][index]["saved_bytes_per_layer"]
                 for run in RUNS if runs[run]["ranks"]}
        print(f"\n{name} rank {ours['rank']} saved bytes per layer: {saved}")
        assert saved["mhc_cg"] <= saved["dev_eager_mhc"] < saved["dev_eager_none"]
        if "dev_graphed_mhc" in saved:
            assert saved["mhc_cg"] < saved["dev_graphed_mhc"]


def test_dev_refuses_its_own_graphed_recompute_beyond_its_split_and_says_why(shipped):
    """Dev graphs its own mHC recompute with ``[attn]`` only, and not under VPP."""
    name, cfg, result, _ = shipped
    graphed = result["runs"]["dev_graphed_mhc"]
    attention_only = cfg.graph.scopes == ["attn", "mhc_recompute"]
    if cfg.parallel.vpp_size == 1 and attention_only:
        assert "refused" not in graphed and graphed["ranks"]
        return
    assert graphed["ranks"] == [] and graphed["losses"] == []
    reason = ("overlap_moe_expert_parallel_comm" if cfg.parallel.vpp_size > 1
              else "only the initial attention-only split")
    assert reason in graphed["refused"]


def test_another_shape_with_the_mlp_graphed_and_counter_dropout():
    """pp 2, 6 layers in blocks of 3, 3 microbatches (an odd count: the first stage holds 2
    in flight), through the job ``mhc-cg megatron`` runs, ``[attn, mlp, mhc_recompute]``
    (``configs/megatron_dev_dense_mlp.yaml``'s scope): both sublayers of every layer, mHC ops
    included, run inside the layer graphs, so a replayed step calls none of their modules or
    mappings as Python. ``hidden_dropout: 0.1`` with dev's layers opted into counter dropout:
    the graphed forward, the recompute graphs, dev's eager run and dev's own ``[mhc]``
    recompute draw the same masks."""
    require_snapshot("dev")
    from mhc_cg.lab.megatron_harness.child_process import run_megatron_job
    from mhc_cg.lab.megatron_harness.runs import compare_ranks

    cfg = load_config(ROOT / "configs/megatron_dev_dense_mlp.yaml").replace(
        model={"num_layers": 6, "recompute_layers": 3, "hidden_dropout": 0.1,
               "dropout_impl": "counter"},
        train={"num_microbatches": 3, "device": "cpu"},
        parallel={"tp_size": 1, "sequence_parallel": False})
    runs = ["dev_eager_none", "dev_eager_mhc", "mhc_cg"]
    per_rank = run_megatron_job({"config": cfg.to_dict(), "runs": runs, "device": "cpu",
                                 "branch": "dev"}, world_size=2, timeout=300)
    result = compare_ranks([r["runs"] for r in per_rank], "dev")
    assert result["bit_identical"] is True, result["mismatches"]
    assert result["runs"]["dev_eager_mhc"]["losses"] == result["runs"]["dev_eager_none"]["losses"]
    reference = compare_ranks([{"dev_eager_none": r["runs"]["dev_eager_none"],
                                "mhc_cg": r["runs"]["dev_eager_mhc"]} for r in per_rank], "dev")
    assert reference["bit_identical"] is True  # dev's own recompute draws the same masks too
    planned = _schedule_slot_sets(cfg)
    for rank in result["runs"]["mhc_cg"]["ranks"]:
        assert rank["persistent_slot_sets"] == planned[rank["pp_rank"]]
        assert rank["layer_graph_replays_per_step"] == 2 * 3 * 3
        assert rank["layer_graphs_not_replayed_in_step"] == 0
        kept = _kept(cfg, rank["pp_rank"])
        assert rank["recompute_graph_replays_per_step"] == 1 * 3 - kept
        assert rank["recomputed_sublayers_per_step"] == 2 * 3 * (3 - kept)
        assert rank["kept_sublayers_per_step"] == 2 * 3 * kept
        assert rank["eager_sublayer_calls_per_step"] == {}
    assert planned == {0: 2, 1: 1}


def test_moe_layers_end_their_graphs_at_megatron_signal_at_ep1_with_counter_dropout():
    """One rank (EP 1), every layer MoE, ``[attn, moe_router, mhc_recompute]``: each layer graph
    ends after the router (megatron's signal); the dispatcher's preprocess, dispatch, experts and
    combine run eagerly from the graph's outputs and the MLP sublayer's mHC post writes the same
    slots. ``hidden_dropout: 0.1`` with counter dropout: bit-identical to dev's eager run without
    recompute; in a replayed step nothing of either sublayer runs as Python but the MoE layer's
    eager rest, and the recompute graphs replay once per block and microbatch."""
    require_snapshot("dev")
    from mhc_cg.lab.megatron_harness.child_process import run_megatron_job
    from mhc_cg.lab.megatron_harness.runs import compare_ranks

    m, layers = 2, 4
    cfg = load_config(ROOT / CONFIGS["moe_partial"]).replace(
        model={"moe_layer_freq": 1, "hidden_dropout": 0.1, "dropout_impl": "counter"},
        train={"num_microbatches": m, "device": "cpu"}, parallel={"pp_size": 1, "ep_size": 1},
        graph={"cuda_graph_modules": ["attn", "moe_router", "mhc_recompute"]})
    per_rank = run_megatron_job({"config": cfg.to_dict(), "runs": ["dev_eager_none", "mhc_cg"],
                                 "device": "cpu", "branch": "dev"}, world_size=1, timeout=300)
    result = compare_ranks([r["runs"] for r in per_rank], "dev")
    assert result["bit_identical"] is True, result["mismatches"]
    (ours,), (reference,) = (result["runs"][run]["ranks"] for run in ("mhc_cg", "dev_eager_none"))
    assert ours["layer_graph_replays_per_step"] == 2 * layers * m
    assert ours["layer_graphs_not_replayed_in_step"] == 0
    # each microbatch's backward directly follows its forward: its last block is kept
    assert ours["recompute_graph_replays_per_step"] == (layers // cfg.model.recompute_layers - 1) * m
    assert ours["recompute_blocks_kept_per_step"] == m
    assert ours["recomputed_sublayers_per_step"] + ours["kept_sublayers_per_step"] == \
        2 * layers * m
    # the MoE layer's forward (its eager rest) once per layer and microbatch, and the preprocess
    # the route-only graph leaves out; no norm, mHC mapping, attention or router outside a graph
    assert ours["eager_sublayer_calls_per_step"] == {"mlp": layers * m,
                                                     "moe_preprocess": layers * m}
    assert ours["saved_bytes_per_layer"] < reference["saved_bytes_per_layer"]


def test_bad_combinations_are_one_line_each_before_any_process(tmp_path):
    config = tmp_path / "bad.yaml"
    text = (ROOT / CONFIGS["tp2_pp2"]).read_text()
    config.write_text(text.replace("tp_size: 2", "tp_size: 3").replace("num_layers: 4",
                                                                       "num_layers: 3")
                      .replace("hidden_dropout: 0.0", "hidden_dropout: 0.1"))
    proc = _cli("megatron", "--config", str(config))
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    for field in ("model.num_heads", "model.num_layers", "model.dropout_impl"):
        assert any(line.startswith(f"mhc-cg megatron: error: {field}:") for line in lines), field
    # torch's stateful dropout: the line names the setting that fixes it
    assert any("set model.dropout_impl: counter" in line for line in lines)
    missing = _cli("megatron", "--config", CONFIGS["pp2_vpp2"],
                   env={"MHC_CG_THIRD_PARTY": str(tmp_path), "MHC_CG_MEGATRON_LM_DEV": ""})
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "MHC_CG_MEGATRON_LM_DEV" in missing.stderr.strip()
    from mhc_cg.core.errors import ConfigError
    from mhc_cg.lab.resolve import train_config

    with pytest.raises(ConfigError, match=r"parallel\.tp_size: 2: mhc_cg's own model \(mhc-cg train"):
        train_config(load_config(ROOT / CONFIGS["tp2_pp2"]), steps=1, progress=False)
    moe = load_config(ROOT / CONFIGS["moe_partial"])
    with pytest.raises(ConfigError, match=r"parallel\.ep_size: 2: mhc_cg's own model \(mhc-cg train"):
        train_config(moe.replace(parallel={"pp_size": 1}), steps=1, progress=False)


@pytest.mark.parametrize("change, field, fix", [
    (dict(graph={"cuda_graph_modules": ["attn", "moe", "mhc_recompute"]}),
     "graph.cuda_graph_modules", "use 'moe_router' [+ 'moe_preprocess']"),
    (dict(megatron={"branch": "main"}, parallel={"pp_size": 1, "ep_size": 1}),
     "model.num_experts", "megatron.branch: dev"),
    (dict(parallel={"ep_size": 3}), "parallel.ep_size", "divisor of 4"),
    (dict(model={"moe_layer_freq": [0, 1]}), "model.moe_layer_freq", "list of 4 entries"),
])
def test_bad_moe_settings_are_one_line_naming_the_fix(tmp_path, capsys, change, field, fix):
    """In process (the console script's exit code and stderr are the same ``main``'s, and the
    subprocess path is the bad-combinations test's)."""
    import yaml

    from mhc_cg.cli import main

    config = yaml.safe_load((ROOT / CONFIGS["moe_partial"]).read_text())
    for section, values in change.items():
        config[section].update(values)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["megatron", "--config", str(path)]) == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(f"mhc-cg megatron: error: {field}:")]
    assert len(lines) == 1 and fix in lines[0], stderr


# pp 2 runs inside tp2sp_pp2 (and in the dev shapes above); the MLP in the layer graphs or not
CORE_SHAPES = {"pp2_vpp2": dict(pp_size=2, vpp_size=2, tp_size=1, m=4, recompute_layers=1,
                                scopes=["attn", "mlp", "mhc_recompute"]),
               "tp2sp_pp2": dict(pp_size=2, vpp_size=1, tp_size=2, m=2, recompute_layers=2,
                                 scopes=["attn", "mhc_recompute"])}


@pytest.mark.parametrize("shape", sorted(CORE_SHAPES))
def test_our_layer_on_megatron_core_0_16_at_scale_is_bit_identical(shape):
    """megatron-core 0.16.1 (no mHC guard, no mHC in its schedules) with mhc_cg's own layer under
    its TE graph helper, counter dropout 0.1: bit-identical to the same model without recompute on
    every rank; under sequence parallelism the mHC parameters' gradients are summed over the
    tensor-parallel ranks like the norms'."""
    from mhc_cg.lab.megatron_harness.child_process import run_megatron_job
    from mhc_cg.lab.megatron_harness.runs import compare_ranks

    s = CORE_SHAPES[shape]
    cfg = load_config(ROOT / CONFIGS["pp2_vpp2"]).replace(
        model={"hidden_dropout": 0.1, "dropout_impl": "counter",
               "recompute_layers": s["recompute_layers"]},
        train={"num_microbatches": s["m"], "device": "cpu"},
        parallel={"pp_size": s["pp_size"], "vpp_size": s["vpp_size"], "tp_size": s["tp_size"],
                  "sequence_parallel": s["tp_size"] > 1},
        megatron={"branch": "core"}, graph={"cuda_graph_modules": s["scopes"]})
    per_rank = run_megatron_job({"config": cfg.to_dict(), "runs": ["core_eager_none", "mhc_cg"],
                                 "device": "cpu", "branch": "core"},
                                world_size=s["tp_size"] * s["pp_size"], timeout=300)
    result = compare_ranks([r["runs"] for r in per_rank], "core")
    assert result["bit_identical"] is True, result["mismatches"]
    planned = _schedule_slot_sets(cfg)
    layers = cfg.model.num_layers // s["pp_size"]
    blocks = layers // s["recompute_layers"]
    for ours, reference in zip(result["runs"]["mhc_cg"]["ranks"],
                               result["runs"]["core_eager_none"]["ranks"]):
        assert ours["persistent_slot_sets"] == planned[ours["pp_rank"]]
        assert ours["layer_graph_replays_per_step"] == 2 * layers * s["m"]
        assert ours["layer_graphs_not_replayed_in_step"] == 0
        kept = _kept(cfg, ours["pp_rank"])
        assert ours["recompute_blocks_kept_per_step"] == kept
        assert ours["recompute_graph_replays_per_step"] + kept == blocks * s["m"]
        assert ours["saved_bytes_per_layer"] < reference["saved_bytes_per_layer"]
        # attention always in the graphs; the MLP sublayer (F, norm, mHC) in them with 'mlp'
        eager = ours["eager_sublayer_calls_per_step"]
        assert eager.get("attention", 0) == 0
        if "mlp" in s["scopes"]:
            assert eager == {}
        else:  # F, norm and mappings of each layer's MLP sublayer, each microbatch
            assert eager["mlp"] == 3 * layers * s["m"]
    _assert_sequence_parallel_grads_summed(result["runs"]["mhc_cg"]["ranks"], s["tp_size"])


def _assert_sequence_parallel_grads_summed(ranks: list[dict], tp_size: int) -> None:
    """Under sequence parallelism every tensor-parallel rank of a stage holds the same gradients
    of the parameters it holds whole (norms, mHC mappings, biases): one not marked for megatron's
    sum keeps its own slice's partial gradient and breaks this."""
    if tp_size == 1:
        return
    by_stage: dict[int, set] = {}
    for rank in ranks:
        by_stage.setdefault(rank["pp_rank"], set()).add(tuple(rank["replicated_grad_digests"]))
    assert all(len(digests) == 1 for digests in by_stage.values()), by_stage

