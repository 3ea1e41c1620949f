"""`mhc-cg timeline compare`: figures from small nsys exports and Chrome traces, checked by hand."""

from __future__ import annotations

import gzip
import json
import sqlite3

import pytest
from torch.profiler import ProfilerActivity, profile

from mhc_cg.cli import main
from mhc_cg.config import RunConfig
from mhc_cg.core.nvtx import enable, enabled_parts
from mhc_cg.lab.profiling.traces import range_stats, read_timeline, total_stats
from mhc_cg.lab.resolve import train_config

TID = (100 << 24) | 7  # nsys globalTid: process 100, thread 7
OTHER_TID = (100 << 24) | 8
PID = 100 << 24  # nsys globalPid: the thread bits are zero
FOREIGN_PID = 200 << 24


def write_nsys_export(path, ranges, runtime, kernels, string_ids):
    """An SQLite file with the columns of nsys's export that the reader uses (and a few it ignores)."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, rangeId INT,
            category INT, color INT, text TEXT, globalTid INT, endGlobalTid INT, textId INT,
            domainId INT, uint64Value INT, int64Value INT, doubleValue REAL, uint32Value INT,
            int32Value INT, floatValue REAL, jsonTextId INT, jsonText TEXT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT NOT NULL, end INT NOT NULL,
            eventClass INT NOT NULL, globalTid INT, correlationId INT, nameId INT NOT NULL,
            returnValue INT NOT NULL, callchainId INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL,
            deviceId INT NOT NULL, contextId INT NOT NULL, streamId INT NOT NULL,
            correlationId INT, globalPid INT, demangledName INT NOT NULL, shortName INT NOT NULL);
    """)
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", string_ids.items())
    db.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, textId, globalTid, domainId) "
                   "VALUES (?, ?, ?, ?, ?, ?, 0)", ranges)
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, ?, 0, 0)", runtime)
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, ?, ?, ?, 9, 9)", kernels)
    db.commit()
    db.close()
    return path


@pytest.fixture
def nsys_export(tmp_path):
    strings = {1: "fwd/0/0/0", 2: "cudaLaunchKernel_v7000", 3: "cudaGraphLaunch_v10000",
               5: "cudaMemcpyAsync_v3020", 9: "some_kernel"}
    ranges = [  # (start, end, eventType, text, textId, globalTid)
        (1000, 5000, 59, None, 1, TID),            # fwd, registered string (textId)
        (10000, 14000, 59, "fwd/0/0/0", None, TID),  # fwd again, plain text
        (20000, 30000, 60, "bwd/0/0/0", None, TID),  # a start/end range
        (0, 40000, 59, "other", None, OTHER_TID),    # another thread: launches on TID are not its
        (1500, None, 34, "a mark", None, TID),       # a marker: not a range
    ]
    runtime = [  # (start, end, globalTid, correlationId, nameId)
        (1100, 1300, TID, 1, 2),
        (1500, 1600, TID, 2, 2),
        (1700, 1800, TID, 3, 5),     # a memcpy call: neither a launch nor a kernel
        (10100, 10200, TID, 4, 3),   # one graph launch, three kernels
        (20100, 20300, TID, 7, 2),
        (29900, 29950, TID, 8, 2),
    ]
    kernels = [  # (start, end, streamId, correlationId, globalPid)
        (2000, 3000, 7, 1, PID), (3500, 4000, 7, 2, PID),
        (11000, 12000, 7, 4, PID), (11500, 12500, 8, 4, PID), (13000, 13500, 7, 4, PID),
        (21000, 26000, 7, 7, PID),
        (31000, 32000, 7, 8, PID),         # runs after bwd closed: still bwd's work
        (40000, 41000, 7, 999, PID),       # no launch call recorded: totals only
        (50000, 50100, 7, 1, FOREIGN_PID),  # another process reusing correlation id 1
    ]
    return write_nsys_export(tmp_path / "run.sqlite", ranges, runtime, kernels, strings)


def test_nsys_export_figures_per_range_match_hand_computed(nsys_export):
    t = read_timeline(nsys_export)
    assert t.kind == "nsys"
    stats = range_stats(t)
    assert list(stats) == ["other", "fwd/0/0/0", "bwd/0/0/0"]  # order of first start
    fwd = stats["fwd/0/0/0"].to_json()
    # instance 1: kernels [2000,3000] + [3500,4000]: busy 1500 ns, window 2000 -> idle 500;
    #   launches at [1100,1300], [1500,1600]: gap 200 (the memcpy call is not a launch).
    # instance 2: one graph launch, kernels [11000,12000] u [11500,12500] u [13000,13500]: busy 2000,
    #   window 2500 -> idle 500.
    assert fwd == {"count": 2, "wall_ms": 0.008, "gpu_time_ms": 0.0035, "kernels": 5, "launches": 3,
                   "launch_gap_ms": 0.0002, "idle_ms": 0.001}
    # bwd: [21000,26000] + [31000,32000] (runs after the range closed): busy 6000, window 11000;
    #   launch gap 29900 - 20300 = 9600.
    assert stats["bwd/0/0/0"].to_json() == {"count": 1, "wall_ms": 0.01, "gpu_time_ms": 0.006,
                                            "kernels": 2, "launches": 2, "launch_gap_ms": 0.0096,
                                            "idle_ms": 0.005}
    other = stats["other"]
    assert (other.kernels, other.launches, other.gpu_ns) == (0, 0, 0)


def test_nsys_totals_cover_unattributed_kernels(nsys_export):
    total = total_stats(read_timeline(nsys_export)).to_json()
    # busy 1000+500+1500+500+5000+1000+1000+100 = 10600; window [2000, 50100] = 48100
    # gaps on thread 7: 200 + (10100-1600) + (20100-10200) + (29900-20300) = 28200
    assert total == {"count": 1, "wall_ms": 0.0501, "gpu_time_ms": 0.0106, "kernels": 9, "launches": 5,
                     "launch_gap_ms": 0.0282, "idle_ms": 0.0375}


def _x(name, cat, ts, dur, tid=1, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def test_cpu_only_chrome_trace_counts_top_level_ops_as_device_work(tmp_path):
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
        _x("fwd/0/0/0", "user_annotation", 0, 100),
        _x("aten::linear", "cpu_op", 10, 20), _x("aten::addmm", "cpu_op", 12, 8),  # nested: not counted
        _x("aten::relu", "cpu_op", 50, 10),
        _x("aten::sum", "cpu_op", 90, 30),  # starts inside the range: its op, even though it ends after
        _x("aten::mul", "cpu_op", 200, 5),
        _x("aten::mul", "cpu_op", 20, 5, tid=2),  # other thread: not the range's
    ]
    path = tmp_path / "cpu.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    t = read_timeline(path)
    assert t.kind == "chrome-cpu"
    # ops [10,30], [50,60], [90,120]: busy 60 us; window 110 -> idle 50; gaps 20 + 30 = 50
    assert range_stats(t)["fwd/0/0/0"].to_json() == {
        "count": 1, "wall_ms": 0.1, "gpu_time_ms": 0.06, "kernels": 3, "launches": 3,
        "launch_gap_ms": 0.05, "idle_ms": 0.05}
    total = total_stats(t)
    # four top-level ops on thread 1, one on thread 2; that one ([20,25]) overlaps [10,30] and
    # counts once: busy = 20 + 10 + 30 + 5 = 65 us
    assert (total.kernels, total.gpu_ns) == (5, 65_000)


def test_cpu_range_opened_inside_an_operator_counts_the_operators_it_contains(tmp_path):
    """A recompute hook runs inside an autograd node: its range sits inside a top-level op."""
    events = [
        _x("autograd::engine::evaluate_function", "cpu_op", 0, 100),
        _x("recompute/0/-/block0", "user_annotation", 10, 60),
        _x("aten::mul", "cpu_op", 15, 10), _x("aten::mul_inner", "cpu_op", 16, 2),  # nested
        _x("aten::add", "cpu_op", 40, 20),
        _x("aten::sum", "cpu_op", 80, 10),  # after the range
    ]
    path = tmp_path / "nested.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    stats = range_stats(read_timeline(path))["recompute/0/-/block0"]
    # outermost ops inside [10, 70]: [15, 25] and [40, 60]; busy 30 us, idle 45 - 30 = 15 us
    assert (stats.kernels, stats.gpu_ns, stats.idle_ns) == (2, 30_000, 15_000)


def test_gpu_chrome_trace_joins_kernels_to_launches_by_correlation(tmp_path):
    events = [
        _x("bwd/0/1/2", "user_annotation", 0, 50),
        _x("cudaLaunchKernel", "cuda_runtime", 5, 5, correlation=11),
        _x("cudaGraphLaunch", "cuda_runtime", 20, 2, correlation=12),
        _x("cudaStreamSynchronize", "cuda_runtime", 30, 10, correlation=13),  # not a launch
        _x("gemm", "kernel", 15, 10, pid=0, tid=7, correlation=11),
        _x("k1", "kernel", 30, 10, pid=0, tid=7, correlation=12),
        _x("k2", "kernel", 45, 15, pid=0, tid=7, correlation=12),
        _x("aten::mm", "cpu_op", 4, 10),  # ignored when the trace has kernels
    ]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(events))  # a bare list of events is a Chrome trace too
    t = read_timeline(path)
    assert t.kind == "chrome-gpu"
    # kernels [15,25], [30,40], [45,60]: busy 35, window 45 -> idle 10; launch gap 20 - 10 = 10
    assert range_stats(t)["bwd/0/1/2"].to_json() == {
        "count": 1, "wall_ms": 0.05, "gpu_time_ms": 0.035, "kernels": 3, "launches": 2,
        "launch_gap_ms": 0.01, "idle_ms": 0.01}


def test_compare_json_has_both_sides_deltas_and_names_missing_on_one_side(nsys_export, tmp_path, capsys):
    other = write_nsys_export(
        tmp_path / "b.sqlite", [(0, 8000, 59, "fwd/0/0/0", None, TID), (9000, 9500, 59, "new", None, TID)],
        [(100, 200, TID, 1, 2)], [(1000, 2000, 7, 1, PID)], {2: "cudaLaunchKernel"})
    assert main(["timeline", "compare", str(nsys_export), str(other), "--json",
                 "--labels", "eager", "graphed"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["a"]["label"], out["b"]["label"], out["a"]["kind"]) == ("eager", "graphed", "nsys")
    rows = {r["name"]: r for r in out["ranges"]}
    assert list(rows) == ["other", "fwd/0/0/0", "bwd/0/0/0", "new"]
    fwd = rows["fwd/0/0/0"]
    assert (fwd["a"]["gpu_time_ms"], fwd["b"]["gpu_time_ms"], fwd["delta"]["gpu_time_ms"]) == (0.0035, 0.001, -0.0025)
    assert (fwd["a"]["kernels"], fwd["b"]["kernels"], fwd["delta"]["kernels"]) == (5, 1, -4)
    assert fwd["b"]["idle_ms"] == 0.0
    assert rows["bwd/0/0/0"]["b"] is None and rows["bwd/0/0/0"]["delta"] is None
    assert rows["new"]["a"] is None and rows["new"]["b"]["count"] == 1
    assert out["totals"]["delta"]["kernels"] == 1 - 9


@pytest.fixture(scope="module")
def real_cpu_traces(tmp_path_factory):
    """Two real torch.profiler CPU traces of `train`: one and two microbatches per step."""
    parts = enabled_parts()
    enable(True)
    folder = tmp_path_factory.mktemp("traces")
    paths = []
    try:
        for microbatches in (1, 2):
            cfg = RunConfig.from_dict({
                "model": {"num_layers": 1, "hidden_size": 16, "num_heads": 2, "seq_length": 8,
                          "vocab_size": 16},
                "train": {"micro_batch_size": 2, "num_microbatches": microbatches}})
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                train_config(cfg, steps=2, device="cpu", progress=False)
            paths.append(folder / f"mb{microbatches}.json")
            prof.export_chrome_trace(str(paths[-1]))
    finally:
        enable(parts["nvtx"], record_function=parts["record_function"])
    return paths


def test_real_cpu_trace_has_the_train_loop_ranges(real_cpu_traces):
    t = read_timeline(real_cpu_traces[1])
    assert t.kind == "chrome-cpu"
    stats = range_stats(t)
    assert {n: stats[n].count for n in ("step", "forward", "backward", "optimizer")} == {
        "step": 2, "forward": 4, "backward": 4, "optimizer": 2}
    for name in ("step", "forward", "backward", "optimizer"):
        s = stats[name]
        assert s.kernels > 0 and 0 < s.gpu_ns <= s.wall_ns
        assert s.gpu_ns + s.idle_ns <= s.wall_ns + 1000 * s.count  # work window within the range (1 us rounding)
    inner = sum(stats[n].kernels for n in ("forward", "backward", "optimizer"))
    assert stats["step"].kernels >= inner  # step encloses the others on the same thread


def test_cli_table_and_png_from_real_traces(real_cpu_traces, tmp_path, capsys):
    png = tmp_path / "cmp.png"
    assert main(["timeline", "compare", *map(str, real_cpu_traces), "--png", str(png),
                 "--labels", "1 microbatch", "2 microbatches"]) == 0
    out = capsys.readouterr().out
    assert "GPU time = union of top-level CPU operator intervals" in out  # the header says what it means
    forward = next(line for line in out.splitlines() if line.startswith("forward "))
    assert forward.split()[1:3] == ["2", "4"]  # n A, n B
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("content, expected", [
    (b"hello, not a trace", "not a profile this tool reads"),
    (b'{"traceEvents": {"no": "list"}}', "expected an object with a 'traceEvents' list"),
    (b'{"traceEvents": [{"ph": "M"}]}', "without complete events"),
    (b'{"traceEvents": [', "unreadable Chrome trace"),
])
def test_foreign_files_fail_with_what_was_expected(tmp_path, capsys, content, expected):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert main(["timeline", "compare", str(bad), str(bad)]) == 2
    assert expected in capsys.readouterr().err


def test_foreign_sqlite_and_nsys_report_are_named(tmp_path, capsys):
    db = sqlite3.connect(tmp_path / "other.sqlite")
    db.execute("CREATE TABLE users (id INT)")
    db.close()
    assert main(["timeline", "compare", str(tmp_path / "other.sqlite"), str(tmp_path / "other.sqlite")]) == 2
    err = capsys.readouterr().err
    assert "not an nsys export" in err and "found: users" in err
    report = tmp_path / "run.nsys-rep"
    report.write_bytes(b"\x00binary report")
    assert main(["timeline", "compare", str(report), str(report)]) == 2
    assert "nsys export --type sqlite" in capsys.readouterr().err
