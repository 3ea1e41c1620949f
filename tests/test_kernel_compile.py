"""Every Triton kernel the fused ops launch compiles for an H100 (sm_90a) without a GPU, through the
real launchers at the model's shapes, and none spills registers; each reports the warps an SM keeps
resident and the bytes they keep in flight (``mhc-cg kernels``)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from mhc_cg.cli import main
from mhc_cg.ops.kernels.dispatch import interpret_requested
from mhc_cg.lab.benchmarks import kernel_compile
from mhc_cg.lab.benchmarks.kernel_compile import (CASES, H100, in_flight, kernel_report, parse_resource_usage,
                                         is_mhc_case, resident_warps)

KERNELS = Path(kernel_compile.__file__).resolve().parents[2] / "ops" / "kernels"
BENCH_HIDDEN = 2048  # configs/bench_h100.yaml: seq 2048 x micro-batch 2 = 4096 tokens, n = 4, bf16
LARGE_HIDDEN = 7168


@pytest.fixture(scope="module")
def report():
    # the suite interprets Triton, so this also checks the compile moves to a child process
    assert interpret_requested()
    return kernel_report([BENCH_HIDDEN, LARGE_HIDDEN], "sm_90a", tokens=4096)


@pytest.mark.parametrize("hidden", [BENCH_HIDDEN, LARGE_HIDDEN])
def test_every_kernel_compiles_for_sm90a_without_spilling(report, hidden):
    shape = next(s for s in report["shapes"] if s["hidden"] == hidden)
    assert (shape["streams"], shape["tokens"], shape["dtype"], shape["iterations"]) == \
        (4, 4096, "bf16", 20)
    # a case launching two kernels (the pre: its state pass, then its chain pass) has two rows
    assert list(dict.fromkeys(row["case"] for row in shape["kernels"])) == \
        [case.name for case in CASES]
    assert {row["kernel"] for row in shape["kernels"]} >= \
        {"_state_part", "_state_sum", "_chain", "_pre_bwd_coef", "_pre_bwd_x", "_post_bwd",
         "_rms_fwd", "_rms_bwd"}
    assert all(0 < row["registers"] <= 255 for row in shape["kernels"]), shape["kernels"]
    spilled = [row for row in shape["kernels"] if row["spilled"]]
    assert not spilled, spilled


def test_every_fused_mhc_kernel_fills_the_h100_four_times_over(report):
    """At the bench shape (hidden 2048, 4096 tokens) every fused mHC kernel's grid has at least
    4 x 132 programs: several blocks per SM to hide latency with."""
    shape = next(s for s in report["shapes"] if s["hidden"] == BENCH_HIDDEN)
    rows = [row for row in shape["kernels"] if is_mhc_case(row["case"])]
    assert rows and all(row["programs"] >= 4 * 132 for row in rows), \
        [(row["case"], row["kernel"], row["programs"]) for row in rows if row["programs"] < 528]
    assert not [line for line in report["few_programs"] if line.startswith(f"hidden {BENCH_HIDDEN}")]


@pytest.mark.parametrize("hidden", [BENCH_HIDDEN, LARGE_HIDDEN])
def test_every_product_runs_on_tensor_cores_and_the_weight_reads_stay_under_half_of_x(report,
                                                                                    hidden):
    """Note [TF32 products] and Note [wide token tiles]: the projection (bf16 and fp32 mapping
    weights) and both products of the pre's backward compile to mma/wgmma, and the projection
    reads at most half as many weight bytes as x bytes; kernels with no product have none."""
    shape = next(s for s in report["shapes"] if s["hidden"] == hidden)
    products = [r for r in shape["kernels"] if r["kernel"] in ("_state_part", "_pre_bwd_x")]
    cases = {r["case"] for r in products}
    assert {"pre", "pre[fp32 weight]", "pre_backward", "pre_backward[fp32 weight]",
            "post_state"} <= cases
    assert all(r["tensor_cores"] for r in products), products
    assert not any(r["tensor_cores"] for r in shape["kernels"]
                   if r["kernel"].startswith(("_chain", "_post_maps", "_rms")))
    weights = [r["weight_per_x"] for r in products if r["kernel"] == "_state_part"]
    assert weights and all(w <= 0.5 for w in weights)


def test_programmatic_dependent_launch_compiles_for_sm90a_as_a_sweep_option(report):
    """Note [programmatic dependent launch]: with a table row's ``pdl``, the state's sum and the
    chain launch with it and wait for the kernel before them in their PTX; by default none does."""
    shape = next(s for s in report["shapes"] if s["hidden"] == BENCH_HIDDEN)
    pdl = {(r["case"], r["kernel"]) for r in shape["kernels"] if r["pdl"]}
    assert pdl == {("pre[pdl]", "_state_sum"), ("fn_input[pdl]", "_chain")}


def _calls_on_impl(tree: ast.AST) -> set[str]:
    """Names called as ``_impl(...).<name>(...)``: the launchers the custom ops use."""
    return {node.func.attr for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Call)
            and getattr(node.func.value.func, "id", None) == "_impl"}


def _launched_kernels(tree: ast.AST) -> set[str]:
    """Names launched as ``kernel[grid](...)``."""
    return {node.func.value.id for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)}


def test_every_launcher_the_ops_call_has_a_case():
    used = _calls_on_impl(ast.parse((KERNELS / "custom_ops.py").read_text()))
    assert len(used) >= 7
    assert used == {case.launcher for case in CASES}, \
        "add a Case for each launcher to CASES in mhc_cg/lab/benchmarks/kernel_compile.py"


def test_every_kernel_launched_is_compiled(report):
    launched = _launched_kernels(ast.parse((KERNELS / "triton_kernels.py").read_text()))
    compiled = {row["kernel"] for shape in report["shapes"] for row in shape["kernels"]}
    assert launched and launched <= compiled, launched - compiled


def test_spill_detection_flags_a_register_hungry_kernel():
    toy = kernel_report([BENCH_HIDDEN], "sm_90a", cases="spill_toy:CASES")
    rows = {row["case"]: row for row in toy["shapes"][0]["kernels"]}
    assert rows["hungry"]["spilled"] and rows["hungry"]["stack"] + rows["hungry"]["local"] > 0
    assert not rows["modest"]["spilled"] and rows["modest"]["stack"] == rows["modest"]["local"] == 0
    assert len(toy["spilled"]) == 1 and "hungry (_minus_max)" in toy["spilled"][0]


def test_cuobjdump_resource_lines_are_read_per_function():
    text = ("\nResource usage:\n Common:\n  GLOBAL:0\n Function _fits:\n"
            "  REG:40 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:656 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
            " Function _spills:\n"
            "  REG:255 STACK:4248 SHARED:0 LOCAL:16 CONSTANT[0]:560 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    usage = parse_resource_usage(text)
    assert usage["_fits"] == {"REG": 40, "STACK": 0, "SHARED": 1024, "LOCAL": 0, "CONSTANT": 656,
                              "TEXTURE": 0, "SURFACE": 0, "SAMPLER": 0}
    assert (usage["_spills"]["STACK"], usage["_spills"]["LOCAL"]) == (4248, 16)


def test_compiling_in_an_interpreting_process_is_refused():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with kernel_compile.compiling_launches(90):
            pass


def test_command_prints_a_table_per_shape_and_exits_1_on_a_spill(report, monkeypatch, capsys):
    monkeypatch.setattr("mhc_cg.lab.benchmarks.kernel_compile.kernel_report", lambda *a, **k: report)
    assert main(["kernels", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("sm_90a, hidden ") == 2 and "REG  STACK  LOCAL  SHARED" in out
    assert "_pre_bwd_x" in out and "SPILLS" not in out
    spilling = {**report, "spilled": ["hidden 7168: rms_norm_backward (_rms_bwd): 8 B local, 0 B stack"]}
    monkeypatch.setattr("mhc_cg.lab.benchmarks.kernel_compile.kernel_report", lambda *a, **k: spilling)
    assert main(["kernels", "--no-progress"]) == 1
    assert "mhc-cg kernels: spills: hidden 7168: rms_norm_backward" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--target", "sm_90"], "Triton compiles capability 90 as sm_90a"),
    (["--target", "hopper"], "use one of sm_75, sm_80"),
    (["--hidden", "2048,abc"], "--hidden: 'abc' is not a positive integer"),
    (["--hidden", "-5"], "--hidden: '-5' is not a positive integer"),
    (["--hidden", "300000"], "index with int32"),
    (["--tokens", "0"], "--tokens: '0' is not a positive integer"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["kernels", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhc-cg kernels: error: ") and message in err[0], err


@pytest.mark.parametrize("registers, warps, shared, programs, expected", [
    # 255 x 32 = 8160 -> 8192 per warp; 65536 / 8192 = 8 warps: one 8-warp block, two 4-warp ones
    (255, 8, 0, None, (8, "registers")),
    (255, 4, 0, None, (8, "registers")),
    # 178 x 32 = 5696 -> 5888 per warp; 11 warps, 8 in groups of 4: two 4-warp blocks
    (178, 4, 4096, None, (8, "registers")),
    # 100 KiB + 1 KiB reserved per block: 228 // 101 = 2 blocks of 4 warps (registers allow 16)
    (32, 4, 100 * 1024, None, (8, "shared")),
    (32, 4, 228 * 1024, None, (0, "shared")),  # over 227 KiB per block: never launches
    # 24 x 32 = 768 per warp: 84 warps by registers, 64 by the SM's warp limit: 4 blocks of 16
    (24, 16, 0, None, (64, "warps")),
    (16, 1, 0, None, (32, "blocks")),  # one-warp blocks stop at 32 blocks per SM
    (40, 4, 0, 256, (8, "grid")),  # 256 programs over 132 SMs: at most 2 blocks each
])
def test_resident_warps_by_hand(registers, warps, shared, programs, expected):
    assert resident_warps(registers, warps, shared, programs) == expected


def test_little_law_by_hand():
    assert H100.bytes_in_flight() == pytest.approx(3.35e12 * 700e-9 / 132)  # ~17765 B per SM
    flight, share = in_flight(64, 8.0)  # a full SM, 8 B per thread: 16 KiB
    assert flight == 16384 and share == pytest.approx(16384 / 17765.15, rel=1e-5) and share < 1


def test_every_kernel_reports_its_warps_and_bytes_in_flight(report):
    assert report["sm"]["bytes_in_flight"] == pytest.approx(H100.bytes_in_flight())
    below = []
    for shape in report["shapes"]:
        for row in shape["kernels"]:
            assert 0 < row["resident_warps"] <= 64 and row["warp_limit"] in \
                {"registers", "shared", "warps", "blocks", "grid"}, row
            assert row["loads"].startswith(("x[", "g[", "logits[", "state[", "part[")) \
                and row["load_bytes"] > 0, row
            assert row["in_flight"] == row["resident_warps"] * 32 * row["load_bytes"]
            assert row["bandwidth_share"] == pytest.approx(row["in_flight"] / H100.bytes_in_flight())
            if row["bandwidth_share"] < 1:
                below.append(f"hidden {shape['hidden']}: {row['case']} ({row['kernel']})")
    assert [line.split(":", 2)[0] + ":" + line.split(":", 2)[1] for line in report["below_bandwidth"]] \
        == below


def test_command_json_and_table_carry_the_in_flight_columns(report, monkeypatch, capsys):
    monkeypatch.setattr("mhc_cg.lab.benchmarks.kernel_compile.kernel_report", lambda *a, **k: report)
    assert main(["kernels", "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    fields = {"resident_warps", "warp_limit", "loads", "load_bytes", "in_flight", "bandwidth_share"}
    assert all(fields <= set(row) for shape in printed["shapes"] for row in shape["kernels"])
    assert main(["kernels", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "WARPS/SM" in out and "in flight/SM" in out and "17765 B per SM" in out


def test_tiny_loads_per_thread_are_flagged():
    toy = kernel_report([BENCH_HIDDEN], "sm_90a", cases="inflight_toy:CASES")
    rows = {row["case"]: row for row in toy["shapes"][0]["kernels"]}
    sip, gulp = rows["sip"], rows["gulp"]
    # one-warp blocks: 32 blocks per SM, 32 threads each with 2 bytes out: 2 KiB of ~17.8 KB
    assert (sip["resident_warps"], sip["warp_limit"], sip["load_bytes"]) == (32, "blocks", 2)
    assert sip["in_flight"] == 2048 and sip["bandwidth_share"] < 0.2
    assert gulp["load_bytes"] == 64 and gulp["bandwidth_share"] > 1
    assert len(toy["below_bandwidth"]) == 1 and "sip (_copy)" in toy["below_bandwidth"][0]


# the fused op -> the case (or cases, for an op whose arguments choose what it launches) that
# launches what it launches
OP_CASES: dict[str, str | tuple[str, ...]] = {
    "mhc_cg::pre": "pre", "mhc_cg::pre_into": "pre",
    # in a chain a pre's backward takes its posts' halves (in place or not); alone it does not
    "mhc_cg::pre_backward": ("pre_backward", "pre_backward[no norm]", "pre_backward[fused]"),
    "mhc_cg::pre_backward_into": ("pre_backward[in place]", "pre_backward[fused]"),
    "mhc_cg::post_grad_y": "post_grad_y",
    "mhc_cg::post_maps": "post_maps", "mhc_cg::post": "post", "mhc_cg::post_into": "post",
    "mhc_cg::post_state": "post_state", "mhc_cg::post_state_into": "post_state",
    "mhc_cg::pre_from_state": "fn_input", "mhc_cg::pre_from_state_into": "fn_input",
    "mhc_cg::post_backward": "post_backward",
    "mhc_cg::recompute": "recompute", "mhc_cg::rms_norm": "rms_norm",
    "mhc_cg::rms_norm_backward": "rms_norm_backward", "mhc_cg::cross_entropy": "cross_entropy",
    "mhc_cg::cross_entropy_backward": "cross_entropy_backward",
}


def kernel_shares(hidden: int, tokens: int, gpu: str = "h100") -> dict[str, float]:
    """``{fused op: in-flight share}`` at ``hidden`` and ``tokens``: the lowest share among the
    kernels its cases launch, capped at 1. A compile-time check of whether a kernel can keep the
    HBM busy, not what the step model charges (that is measured: ``mhc_cg.lab.cost.step_model``)."""
    from mhc_cg.lab.benchmarks.kernel_compile import kernel_report

    report = kernel_report(hidden=(hidden,), tokens=tokens, gpu=gpu)
    lowest: dict[str, float] = {}
    for kernel in report["shapes"][0]["kernels"]:
        share = kernel["bandwidth_share"]
        if share is not None:
            lowest[kernel["case"]] = min(lowest.get(kernel["case"], share), share)
    shares = {}
    for op, cases in OP_CASES.items():
        found = [lowest[case] for case in ((cases,) if isinstance(cases, str) else cases)
                 if case in lowest]
        if found:
            shares[op] = min(1.0, *found)
    return shares


def test_the_in_flight_estimate_is_a_check_and_the_step_model_charges_measurements():
    """``mhc-cg kernels``' in-flight share (Little's law on the sm_90a cubins) is a compile-time
    check: every fused op gets one, lower on the H200 (more bytes to keep in flight per SM). The
    step model charges something else: each fused op from the copy bandwidth (low) to its kind's
    eager-measured share (high) until this code's kernels are timed, never a figure without a
    source; a step then takes longer at the high end on the same bytes."""
    from mhc_cg.config import load_config
    from mhc_cg.lab.cost.measured import FUSED_KINDS
    from mhc_cg.lab.cost.report import cost_report
    from mhc_cg.lab.cost.step_model import step_model

    shares = kernel_shares(BENCH_HIDDEN, 4096)
    assert set(shares) == set(OP_CASES) and all(0 < s <= 1 for s in shares.values())
    on_h200 = kernel_shares(BENCH_HIDDEN, 4096, gpu="h200")
    assert all(on_h200[op] <= share for op, share in shares.items())
    assert any(on_h200[op] < share for op, share in shares.items())
    charges = step_model("h100").fused
    assert set(charges) == set(FUSED_KINDS)
    assert all(c.low == 1.0 and c.high < 1 and c.source for c in charges.values())
    cfg = load_config(None)
    peak = cost_report(cfg, "meta", measured=False)
    charged = cost_report(cfg, "meta")
    assert set(charged["gpu"]["fused"]) == set(charges) and not peak["gpu"]["fused"]
    full, slow = (r["modes"]["graphed_static"] for r in (peak, charged))
    assert slow["bytes_per_step"] == full["bytes_per_step"]
    assert full["step_s"]["low"] == full["step_s"]["high"]  # one figure at the HBM peak
    assert slow["step_s"]["high"] > slow["step_s"]["low"] > full["step_s"]["low"]


def test_kernels_bench_without_a_gpu_says_to_rehearse(capsys):
    import torch

    from mhc_cg.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["kernels", "--bench"]) == 2
    assert "add --dry-run" in capsys.readouterr().err
    assert main(["kernels", "--sweep"]) == 2
