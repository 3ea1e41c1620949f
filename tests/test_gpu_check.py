"""``bench/gpu_check.sh --dry-run``: every part of the GPU checklist on the CPU (tape backend, tiny
config), each packed into its archive, all of it within what a device call brings back and unpacked
by ``python -m mhc_cg.lab.benchmarks.gpu_run unpack``; and the probe's pieces on hand-made inputs."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhc_cg.lab.benchmarks import gpu_run
from mhc_cg.lab.benchmarks import gpu_probe as probe
REPO = Path(__file__).resolve().parent.parent
DRY_MODES = ["eager_none", "graphed_static", "graphed_full_static"]
PARTS = ["peers", "bench", "te", "kernels", "layer", "megatron", "tests"]
ARCHIVES = [part for part in PARTS if part != "layer"]  # the layer part's files join megatron's
# what a device call brings back from $OUT
MAX_FILES, MAX_DEPTH, MAX_BYTES = 8, 2, 16 * 2 ** 20


def run_check(out: Path, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, **env}
    environ.pop("OUT", None)
    return subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", str(out)], cwd=REPO,
                          env=environ, capture_output=True, text=True, timeout=900)


def summary(out: Path) -> dict[str, dict]:
    with open(out / "summary.tsv") as f:
        return {row["part"]: row for row in csv.DictReader(f, delimiter="\t")}


@pytest.fixture(scope="module")
def dry_out(tmp_path_factory):
    """The folder the checklist leaves, as a device call would bring it back."""
    out = tmp_path_factory.mktemp("gpu_check")
    done = run_check(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def dry_run(dry_out, tmp_path_factory):
    """The same, unpacked: every part's files."""
    return gpu_run.unpack(dry_out, tmp_path_factory.mktemp("unpacked") / "gpu_check_cpu")


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_everything_comes_back_from_a_device_call(dry_out):
    """At most 8 files, none more than two folders down, none over 16 MiB: env.txt, the summary
    and one archive per part; no shapes or scratch beside them."""
    found = files_under(dry_out)
    assert len(found) <= MAX_FILES, found
    assert all(len(p.relative_to(dry_out).parts) <= MAX_DEPTH + 1 for p in found)
    assert all(p.stat().st_size <= MAX_BYTES for p in found)
    assert sorted(p.name for p in found) == sorted(
        ["env.txt", "summary.tsv", *(f"{part}.tar.gz" for part in ARCHIVES)])


@pytest.mark.slow
def test_unpack_restores_every_parts_files(dry_out, dry_run):
    """What each part wrote, back under bench/results/gpu_check_<device>/ (``cpu`` here)."""
    assert gpu_run.device_of((dry_out / "env.txt").read_text()) == "cpu"
    names = {str(p.relative_to(dry_run)) for p in files_under(dry_run)}
    assert {"env.txt", "summary.tsv", "peers/peers.json", "peers/peers.log", "bench/bench.log",
            "bench/cpu.dry_shape.json", "bench/cpu.dry_memory.json", "bench/cpu.md",
            "kernels/kernel_bench.json", "kernels/kernel_efficiency.json",
            "kernels/launch_configs.json", "kernels/kernels.log", "megatron/compare.json",
            "megatron/layer_time.json", "megatron/layer_cost.json",
            "te/cpu.dry_te.json", "te/bench.log",
            "tests/pytest.log", "tests/junit.xml"} <= names
    assert not any(name.endswith(".yaml") for name in names)  # the dry run's shapes stay behind


def test_an_archive_over_the_limit_leaves_out_its_largest_files_and_says_so(tmp_path):
    """A part whose files would not come back in one archive keeps the rest, and names what it
    left out."""
    done = run_check(tmp_path / "out", GPU_CHECK_PARTS="tests",
                     GPU_CHECK_MAX_ARCHIVE_BYTES="500")
    assert summary(tmp_path / "out")["tests"]["status"] == "ok", done.stderr[-2000:]
    archive = tmp_path / "out" / "tests.tar.gz"
    assert archive.stat().st_size <= 500
    unpacked = gpu_run.unpack(tmp_path / "out", tmp_path / "back")
    left_out = (unpacked / "tests" / "LEFT_OUT.txt").read_text()
    assert "junit.xml" in left_out and not (unpacked / "tests" / "junit.xml").exists()
    # the largest first: the log goes only if the archive is still too big without the XML
    assert (unpacked / "tests" / "pytest.log").exists() or "tests/pytest.log" in left_out


@pytest.mark.slow
def test_fold_merges_the_measurements_and_back_tests_each_bench_on_its_gpu(dry_out, tmp_path):
    """``gpu_run fold``: the run unpacked; its kernel rows (copy bandwidth and each op's device
    time) merged into what the step model reads, its sweep into what the launchers read; a
    bench JSON taken on a GPU back-tested on that GPU's model, the error printed per mode (the
    dry run's, relabelled as an H200's: the CPU is no GPU of the model, and says so)."""
    from mhc_cg.lab.cost.backtest import backtest, errors

    results, table = tmp_path / "results", tmp_path / "launch_configs.json"
    said = gpu_run.fold(dry_out, results=results, launch_table=table, docs=False)
    assert (results / "gpu_check_cpu" / "kernels" / "kernel_bench.json").is_file()
    merged = json.loads((results / "kernel_efficiency.json").read_text())["rows"]
    assert {r["class"] for r in merged} == {"copy", "fused mHC"}
    assert json.loads(table.read_text())["rows"]
    assert any(line.startswith("back-test: none (cpu") for line in said)

    bench = json.loads((results / "gpu_check_cpu" / "bench" / "cpu.dry_shape.json").read_text())
    bench.update(device="NVIDIA H200", device_type="cuda")
    for entry in bench["modes"].values():
        entry.update(peak_allocated_bytes=2 ** 20, peak_reserved_bytes=2 ** 21)
    as_h200 = tmp_path / "h200.json"
    as_h200.write_text(json.dumps(bench))
    result = backtest(as_h200, rows=[])
    assert result["gpu"] == "h200" and not result["side_by_side"]
    assert list(result["modes"]) == DRY_MODES
    for r in result["modes"].values():
        assert r["modelled_peak"] > 0 and r["modelled_reserved"] >= r["modelled_peak"]
        assert 0 < r["modelled_step_ms"]["low"] <= r["modelled_step_ms"]["high"]
    lines = errors(result)
    assert len(lines) == 1 + len(DRY_MODES) and all(" to " in line for line in lines[1:])


def test_device_names_and_slugs():
    from mhc_cg.lab.cost.gpus import name_slug

    assert gpu_run.device_of("python 3.12\ngpu NVIDIA H200\ntriton: yes") == "NVIDIA H200"
    assert gpu_run.device_of("gpu none\n") == "cpu"
    assert name_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


@pytest.mark.slow
def test_every_part_ends_ok_and_in_order(dry_run):
    """The parts in the order a GPU run needs them most: the peers beside ours, the bench, its
    graphed_static row under TE's own function, the kernel table, Megatron under its own helper,
    the cuda tests."""
    parts = summary(dry_run)
    assert list(parts) == PARTS
    assert {p: r["status"] for p, r in parts.items()} == {p: "ok" for p in parts}
    assert all(0 <= int(r["seconds"]) <= int(r["limit_s"]) for r in parts.values())
    env = (dry_run / "env.txt").read_text()
    assert f"torch {torch.__version__}" in env and "gpu none" in env


def test_the_gpu_run_fits_nine_minutes():
    """The limits of a real run add up to at most 540 s, the peers first."""
    text = (REPO / "bench" / "gpu_check.sh").read_text()
    real = text[text.index("BUDGET=${GPU_CHECK_BUDGET_S:-540}"):]
    limits = real[real.index("LIMITS=(") + 8:real.index(")")].split()
    assert [kv.split("=")[0] for kv in limits] == PARTS
    assert sum(int(kv.split("=")[1]) for kv in limits) <= 540


@pytest.mark.slow
def test_peers_part_compares_every_op_with_every_peer(dry_run):
    """``mhc-cg kernels --peers --dry-run``: every op family beside TransformerEngine's,
    Megatron-LM dev's and torch's (main's module), at fp32 and bf16, ours in each peer's own mHC
    arithmetic and (fp32) in the other, every row within its tolerance; what cannot run says
    why (the TE wheel missing, the interpreter's bf16 dot). Dev's arithmetic beside dev's own
    fused module is closer than main's there."""
    from mhc_cg.lab.benchmarks import kernel_peers
    from mhc_cg.lab.megatron_harness.child_process import snapshot_archive

    report = json.loads((dry_run / "peers" / "peers.json").read_text())
    printed = (dry_run / "peers" / "peers.log").read_text()  # --json: the same report on stdout
    shown, _ = json.JSONDecoder().raw_decode(printed[printed.index("{"):])
    assert shown["rows"] == report["rows"]
    expected = set(kernel_peers.PEERS)
    assert kernel_peers.find_te_wheel(REPO) is not None, kernel_peers.te_missing_reason(REPO)
    for peer, branches in (("dev", ("dev",)), ("torch", ("dev", "main"))):
        if any(snapshot_archive(b) is None for b in branches):  # said, not run
            assert "snapshot" in report["skipped"][peer]
            expected.discard(peer)
    assert set(report["peers"]) == expected and not set(report["skipped"]) & expected
    gaps = {(g["peer"], g["dtype"], op) for g in report["not_run"] for op in g["ops"]}
    assert all("interpreter" in g["why"] for g in report["not_run"])
    rows = {(r["peer"], r["dtype"], r["op"], r["arithmetic"]): r for r in report["rows"]}
    # ours in the peer's own arithmetic at both dtypes, in the other at fp32
    want = {(p, d, op, a) for p in expected for d in kernel_peers.DRY_DTYPES
            for op in kernel_peers.OPS for a in kernel_peers.ARITHMETICS
            if (p, d, op) not in gaps and (a == kernel_peers.ARITHMETIC_OF[p] or d == "float32")}
    assert set(rows) == want
    assert [key for key, r in rows.items() if not r["ok"]] == []
    assert all(r["rtol"] == kernel_peers.RTOL[r["dtype"]] for r in rows.values())
    assert all(r["h_res_transposed"] == (r["peer"] != "torch") for r in rows.values())
    if "dev" in expected:
        for op in kernel_peers.OPS:
            closer, farther = (rows[("dev", "float32", op, a)]["max_abs_diff"] for a in ("dev", "main"))
            assert closer <= farther, op


@pytest.mark.slow
def test_bench_runs_both_shapes_each_mode_in_its_own_process(dry_run):
    for shape in ("dry_shape", "dry_memory"):
        report = json.loads((dry_run / "bench" / f"cpu.{shape}.json").read_text())
        assert list(report["modes"]) == DRY_MODES
        pids = {e["pid"] for e in report["modes"].values()}
        assert len(pids) == len(DRY_MODES)
        assert report["modes"]["graphed_static"]["losses_equal_eager_none"] is True
        full = report["modes"]["graphed_full_static"]
        assert full["losses_equal_eager_none"] is True
        assert "iteration" in full["profile"]["phases"]  # every forward and backward: one replay
        assert all(e["profile"]["phases"] for e in report["modes"].values())
    memory = json.loads((dry_run / "bench" / "cpu.dry_memory.json").read_text())
    assert memory["config"]["model"]["seq_length"] == 32


@pytest.mark.slow
def test_te_part_runs_graphed_static_under_tes_own_function(dry_run):
    """One bench row whose graphs TE's own ``make_graphed_callables`` captured, from its wheel:
    the JSON names the capturing function's file and sha256; its losses equal eager's."""
    from mhc_cg.graphs.te import source_of
    from mhc_cg.lab.emulation.te_wheel import find_te_wheel
    from mhc_cg.lab.emulation.backends import graph_api

    report = json.loads((dry_run / "te" / "cpu.dry_te.json").read_text())
    assert list(report["modes"]) == ["graphed_static"]
    capture = report["modes"]["graphed_static"]["capture"]
    assert capture["origin"] == "wheel" and capture["version"] == "2.20.2"
    assert capture["file"].startswith(str(find_te_wheel().resolve()))
    assert capture["sha256"] == source_of(graph_api("te").function)["sha256"]
    bench = json.loads((dry_run / "bench" / "cpu.dry_shape.json").read_text())
    assert report["modes"]["graphed_static"]["losses"] == bench["modes"]["eager_none"]["losses"]


@pytest.mark.slow
def test_cuda_tests_ran_and_skipped_cleanly(dry_run):
    log = (dry_run / "tests" / "pytest.log").read_text()
    assert "skipped" in log and "failed" not in log
    assert "<testsuite" in (dry_run / "tests" / "junit.xml").read_text()


@pytest.mark.slow
def test_the_kernel_part_writes_the_tables_the_launchers_and_the_cost_model_read(dry_run,
                                                                                monkeypatch):
    """``mhc-cg kernels --bench --sweep --dry-run``: the fused ops of an eager step timed
    (through Triton's interpreter here), every tunable kernel's configurations swept; the
    fastest become rows the launchers read, the op timings rows ``mhc-cg cost`` charges as
    measured at this kernel source (once they are an H100's)."""
    from mhc_cg.ops.kernels.launch import DEFAULTS, ENV, TUNABLE, launch_config
    from mhc_cg.lab.cost.measured import kernel_source_sha256
    from mhc_cg.lab.cost.step_model import step_model

    report = json.loads((dry_run / "kernels" / "kernel_bench.json").read_text())
    assert [s["shape"] for s in report["shapes"]] == ["dry_bench", "dry_memory"]
    ops = {r["op"]: r for r in report["shapes"][0]["ops"]}
    assert {"mhc_cg::pre", "mhc_cg::post_state", "mhc_cg::pre_backward_into"} <= set(ops)
    assert all(r["calls"] > 0 and r["device_ms"] > 0 and r["host_us_per_call"] > 0
               for r in ops.values())
    table = dry_run / "kernels" / "launch_configs.json"
    rows = json.loads(table.read_text())["rows"]
    assert sorted(r["kernel"] for r in rows) == sorted(TUNABLE)
    monkeypatch.setenv(ENV, str(table))
    for row in rows:
        assert launch_config(row["kernel"], row["hidden"], torch.device("cpu")) == \
            {**DEFAULTS[row["kernel"]], **row["config"]}
        assert launch_config(row["kernel"], row["hidden"] * 2, torch.device("cpu")) == \
            DEFAULTS[row["kernel"]]  # no row for that hidden size: the defaults
    timed = json.loads((dry_run / "kernels" / "kernel_efficiency.json").read_text())["rows"]
    fused = [r for r in timed if r["class"] == "fused mHC"]
    assert fused and all(r["kernel_source_sha256"] == kernel_source_sha256() for r in fused)
    assert {r["class"] for r in timed} == {"copy", "fused mHC"}  # the copy bandwidth too
    as_h200 = [{**r, "device": "NVIDIA H200"} for r in timed]
    model = step_model("h200", as_h200)
    assert model.fused["mhc_cg::pre"].source.startswith("measured at this code")
    assert model.copy.source.startswith("measured")


@pytest.mark.slow
def test_megatron_main_under_its_own_helper_is_bit_identical_to_main_eager(dry_run):
    """Megatron's helper called TE's own function (the wheel's graph.py, TE's version)."""
    result = json.loads((dry_run / "megatron" / "compare.json").read_text())
    assert result["bit_identical"] is True
    assert {"mhc_cg", "main_eager_none"} <= set(result["runs"])
    assert result["capturing_function"]["file"].endswith(".whl/transformer_engine/pytorch/graph.py")
    assert result["capturing_function"]["te_version"] == "2.20.2"


def test_a_spent_budget_skips_parts_and_says_so(tmp_path):
    done = run_check(tmp_path, GPU_CHECK_BUDGET_S="10")
    assert done.returncode == 1
    parts = summary(tmp_path)
    assert set(r["status"] for r in parts.values()) == {"skipped (budget spent)"}
    assert "tests" in parts and not list(tmp_path.glob("*.tar.gz"))


# ------------------------------------------------------------------------------------------
# The probe's pieces.

def test_snapshot_pool_bytes_sums_segments_per_graph_pool():
    snapshot = [{"segment_pool_id": (0, 0), "total_size": 100},
                {"segment_pool_id": (1, 2), "total_size": 2 << 20},
                {"segment_pool_id": (1, 2), "total_size": 4 << 20},
                {"segment_pool_id": (1, 5), "total_size": 20 << 20},
                {"total_size": 7}]
    assert probe.snapshot_pool_bytes(snapshot) == {(1, 2): 6 << 20, (1, 5): 20 << 20}


def test_compare_kernel_times_both_and_checks_exactness():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    same = probe.KernelCase("double", lambda t: t + t, lambda t: 2 * t, (x,), 2 * x.nbytes)
    row = probe.compare_kernel(same, torch.device("cpu"), bandwidth=1e9, repeats=3)
    assert row["exact"] is True and row["max_abs_diff"] == 0.0
    assert row["bound_ms"] == pytest.approx(1000 * 2 * x.nbytes / 1e9)
    assert row["fused_ms"] > 0 and row["fused_over_bound"] == pytest.approx(
        row["fused_ms"] / row["bound_ms"])
    off = probe.KernelCase("scale", lambda t: t * 1.001, lambda t: t, (x,), 2 * x.nbytes)
    row = probe.compare_kernel(off, torch.device("cpu"), bandwidth=1e9, repeats=1)
    assert row["exact"] is False and row["max_abs_diff"] == pytest.approx(
        (x * 0.001).abs().max().item(), rel=1e-2)


def test_mask_agreement_rows_and_keep_fraction():
    rows = probe.mask_agreement(torch.device("cpu"), [(64, 64)], seeds=[1, 2], streams=[0, 3], p=0.25)
    assert len(rows) == 4 and all(r["equal"] and r["mismatches"] == 0 for r in rows)
    assert all(abs(r["keep_fraction"] - 0.75) < 0.03 for r in rows)


def test_probe_rejects_unknown_parts(capsys):
    assert probe.main(["--out", "unused", "--parts", "pools,gpu"]) == 2
    assert "--parts: unknown part(s) ['gpu']" in capsys.readouterr().err


def test_the_probes_kernel_cases_call_every_fused_op_and_match_the_reference():
    """The GPU probe's cases run here through Triton's interpreter on a tiny shape: each calls
    today's fused ops (a stale case would only fail on the GPU) and agrees with the reference."""
    from mhc_cg.config import MHCGPTConfig, RunConfig

    cfg = RunConfig()
    cfg.model = MHCGPTConfig(vocab_size=32, seq_length=4, hidden_size=16, num_heads=2,
                             num_layers=2, hidden_dropout=0.1, sinkhorn_iterations=4)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=2, dtype="fp32", device="cpu")
    cases = probe.fused_kernel_cases(cfg, torch.device("cpu"))
    assert [case.name for case in cases] == ["pre", "post", "recompute_block", "rms_norm"]
    for case in cases:
        row = probe.compare_kernel(case, torch.device("cpu"), bandwidth=1e9, repeats=1)
        assert row["max_abs_diff"] < 1e-4, row
        assert row["bytes"] > 0


@pytest.mark.slow
def test_layer_part_times_devs_layer_native_and_fused_and_counts_its_kernels(dry_run):
    """The layer part: one step of Megatron-LM dev's mHC layer timed natively and on mhc_cg's
    fused kernels in one process (dev's own fused module says why it did not run off a GPU),
    and its kernels and bytes counted, fewer fused."""
    timed = json.loads((dry_run / "megatron" / "layer_time.json").read_text())
    assert timed["branch"] == "dev" and timed["device"] == "cpu"
    runs = timed["runs"]
    assert runs["native"]["ms_per_step"] > 0 and runs["mhc_cg_fused"]["ms_per_step"] > 0
    assert runs["mhc_cg_fused"]["over_mhc_cg_fused"] == 1.0
    assert "no GPU" in runs["dev_fused_module"]["not_run"]
    cost = json.loads((dry_run / "megatron" / "layer_cost.json").read_text())
    assert cost["fused"]["kernels"] < cost["native"]["kernels"]
