"""``mhc-cg bench`` on CPU (tape backend, tiny model, few steps): each mode in a process of its
own, report schema and file names, graphed_none == eager_none bit for bit, clear errors, and the
recompute lower-bound arithmetic."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from mhc_cg.lab.benchmarks import runner as bench, timing as bench_run
from mhc_cg.cli import main
from mhc_cg.config import load_config
from mhc_cg.lab.registry import MODES
from mhc_cg.lab.resolve import resolve
from helpers import build_for_mode
from mhc_cg.lab.resolve import train_config

TINY = """\
model: {vocab_size: 32, seq_length: 8, hidden_size: 16, num_heads: 2, num_layers: 2,
        num_streams: 4, hidden_dropout: 0.1, dropout_impl: counter, recompute_layers: 2}
train: {micro_batch_size: 2, seed: 7, device: cpu}
graph: {backend: tape}
"""


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def cpu_report(tiny_config, tmp_path_factory):
    """Two modes, each in a process of its own; the report handed over after each."""
    cfg = load_config(tiny_config)
    opts = bench.BenchOptions(modes=("eager_none", "graphed_static"), steps=2, warmup=1,
                              profile_steps=1, recompute_replays=2, bandwidth_bytes=2 ** 16)
    snapshots = []
    reports = bench.run_bench([("tiny", cfg)], torch.device("cpu"), opts,
                              on_shape_done=lambda r: snapshots.append(list(r["modes"])))
    out = tmp_path_factory.mktemp("results")
    bench.write_results(reports, out)
    return out, snapshots


def test_each_mode_runs_in_a_process_of_its_own_and_hands_over_its_results(cpu_report):
    out, snapshots = cpu_report
    assert snapshots == [["eager_none"], ["eager_none", "graphed_static"]]
    assert sorted(p.name for p in out.iterdir()) == ["cpu.md", "cpu.tiny.json"]
    report = json.loads((out / "cpu.tiny.json").read_text())
    pids = [e["pid"] for e in report["modes"].values()]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert report["bench"]["schedule"] == "one_process_per_mode"
    assert report["shape"] == "tiny" and report["config"]["model"]["hidden_size"] == 16


def test_a_report_has_the_schema_the_readme_gives(cpu_report):
    out, _ = cpu_report
    report = json.loads((out / "cpu.tiny.json").read_text())
    assert report["device_type"] == "cpu" and report["device"].startswith("CPU")
    assert "not the targets' conditions" in report["bench"]["caveat"]
    assert "CPU torch keeps no allocator peak counter" in report["bench"]["memory_note"]
    for name, entry in report["modes"].items():
        assert entry["peak_allocated_bytes"] is None and entry["peak_reserved_bytes"] is None
        assert len(entry["step_ms"]) == 2 and entry["step_ms_median"] > 0
        assert entry["tokens_per_s"] == pytest.approx(2 * 8 / (entry["step_ms_median"] / 1e3))
        profile = entry["profile"]
        assert profile["device"] == "cpu" and 0 < profile["busy_share"] <= 1
        assert {"forward", "backward", "optimizer"} <= set(profile["phases"])
        ops = {row["op"]: row for row in entry["fused_ops"]}
        assert ops["mhc_cg::rms_norm"]["calls"] == 1 and ops["mhc_cg::rms_norm"]["bytes"] > 0
    static = report["modes"]["graphed_static"]
    assert static["recompute_graph_ms"] > 0 and static["recompute_lower_bound_ms"] > 0
    # the bound is the block's traffic over the copy bandwidth measured in that process
    assert static["recompute_lower_bound_ms"] == pytest.approx(
        1000.0 * static["recompute_bytes"]["total"] / static["copy_bandwidth_bytes_per_s"])
    # same weights, data and dropout seeds in two processes: the same losses
    assert static["losses_equal_eager_none"] is True
    assert all(t["status"] in ("PASS", "FAIL", "SKIP") for t in report["targets"])
    assert report["targets"][0]["status"] == "SKIP"  # no peak memory on CPU
    md = (out / "cpu.md").read_text()
    assert "| graphed_static |" in md and "not the targets' conditions" in md


def test_a_mode_out_of_time_is_reported_and_the_bench_goes_on(tiny_config):
    opts = bench.BenchOptions(modes=("eager_none", "eager_block"), steps=1, warmup=0,
                              profile_steps=1, mode_timeout_s=0.2)
    modes = bench.run_bench([("tiny", load_config(tiny_config))], torch.device("cpu"),
                            opts)[0]["modes"]
    assert [e["error"] for e in modes.values()] == ["timed out after 0.2 s"] * 2
    assert "failed: timed out" in bench.markdown([{**bench._report_head(
        "tiny", load_config(tiny_config), torch.device("cpu"), opts), "modes": modes}])


def test_two_shapes_with_one_name_are_refused(tiny_config, tmp_path, capsys):
    other = tmp_path / tiny_config.name
    other.write_text(tiny_config.read_text())
    assert main(["bench", "--config", str(tiny_config), "--config", str(other)]) == 2
    assert "--config: two shapes share a file name" in capsys.readouterr().err


@pytest.mark.parametrize("modes", ["eager_none,bogus", "graphed", ","])
def test_bad_modes_exit_2_with_the_known_names(modes, capsys):
    assert main(["bench", "--modes", modes]) == 2
    err = capsys.readouterr().err
    assert "--modes: unknown mode(s)" in err and "graphed_static" in err and "moe_partial" in err


def test_cuda_backend_on_cpu_is_a_clear_error(tiny_config, capsys):
    assert main(["bench", "--config", str(tiny_config), "--device", "cpu", "--backend", "cuda"]) == 2
    assert "use --backend tape" in capsys.readouterr().err


def test_modes_keep_the_canonical_order():
    assert bench.parse_modes("moe_partial, eager_none") == ("eager_none", "moe_partial")


def test_recompute_traffic_matches_hand_computed_bytes(tiny_config):
    cfg = load_config(tiny_config)
    graphed = build_for_mode(cfg, "graphed_static", torch.device("cpu"))
    m, s, b = cfg.model, cfg.model.seq_length, cfg.train.micro_batch_size
    n, c, lr, f32 = m.num_streams, m.hidden_size, m.resolved_recompute_layers, 4
    x_l0 = s * b * n * c * f32
    f_outputs = 2 * lr * s * b * c * f32  # one F output per sublayer, C wide
    seed = 8  # int64
    # per sublayer: mapping_proj (n*C -> n^2 + 2n), three alphas, bias (n^2 + 2n), RMSNorm weight (C)
    params = 2 * lr * (n * c * (n * n + 2 * n) + 3 + (n * n + 2 * n) + c) * f32
    traffic = bench_run.recompute_traffic(graphed, 0)
    assert traffic["read_inputs"] == x_l0 + f_outputs + seed
    assert traffic["read_params"] == params
    assert traffic["write_arena"] == graphed.runtime.arena.nbytes > x_l0  # several n*C slots
    assert traffic["total"] == x_l0 + f_outputs + seed + params + graphed.runtime.arena.nbytes
    assert bench_run.lower_bound_seconds(traffic["total"], 2.0e9) == traffic["total"] / 2.0e9
    with pytest.raises(ValueError):
        bench_run.lower_bound_seconds(1, 0.0)


def test_copy_bandwidth_counts_read_and_write(monkeypatch):
    monkeypatch.setattr(bench_run, "time_repeated", lambda fn, repeats, device: 0.25)
    assert bench_run.copy_bandwidth(torch.device("cpu"), 1000) == 2 * 1000 / 0.25
    assert bench_run.copy_bandwidth(torch.device("cpu"), 1 << 20) > 0  # and it runs for real


def test_targets_check_pass_fail_skip():
    modes = {"eager_none": {"step_ms_median": 100.0, "peak_allocated_bytes": 900},
             "eager_block": {"step_ms_median": 120.0, "peak_allocated_bytes": 500},
             "graphed_static": {"step_ms_median": 105.0, "peak_allocated_bytes": 520,
                                "recompute_graph_ms": 3.0, "recompute_lower_bound_ms": 1.0}}
    got = {t["target"]: t["status"] for t in bench.targets_check(modes)}
    assert got == {"peak <= eager_none": "PASS", "peak <= 1.05 x eager_block": "PASS",
                   "step <= 1.07 x eager_none": "PASS", "step < eager_block": "PASS",
                   "step < attn_split": "SKIP", "recompute graph <= 2 x its bound": "FAIL"}
    modes["attn_split"] = {"step_ms_median": 105.0}  # equal is not below
    assert {t["target"]: t["status"] for t in bench.targets_check(modes)}["step < attn_split"] == "FAIL"
    modes["attn_split"] = {"step_ms_median": 110.0}
    assert {t["target"]: t["status"] for t in bench.targets_check(modes)}["step < attn_split"] == "PASS"
    modes["graphed_static"]["peak_allocated_bytes"] = None
    assert bench.targets_check(modes)[0]["status"] == "SKIP"


def test_moe_partial_config_is_parameter_matched():
    """moe_partial is one thing everywhere: the MoE version of the model (experts together as wide
    as the dense MLP), partially captured; graphed_static trains the config as it is."""
    cfg = load_config(None)
    moe_cfg = resolve(cfg, "moe_partial", "cpu", moe_experts=8, moe_top_k=2).cfg
    assert moe_cfg.graph.cuda_graph_scope == ["attn", "moe_router", "moe_preprocess", "mhc_recompute"]
    assert moe_cfg.model.num_experts * moe_cfg.model.moe_ffn_hidden_size == cfg.model.ffn_hidden_size
    assert moe_cfg.model.recompute == "block" and not MODES["moe_partial"].same_model
    assert resolve(cfg, "graphed_static", "cpu").cfg is cfg
