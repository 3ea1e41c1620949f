"""`pipeline_order`: Megatron's per-rank 1F1B / interleaved order, checked against megatron-core itself."""

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhc_cg.cli import main
from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.planning.planner import plan
from mhc_cg.core.pipeline_order import (decode_order, pass_windows, pipeline_order, recomputes_kept,
                                  schedule_problems)
from mhc_cg.lab.planning.plot import chrome_trace, simulate_timeline

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
cuda_graphs = pytest.importorskip("megatron.core.transformer.cuda_graphs")


def megatron_order(pp, rank, m, vpp, group):
    """The order Megatron's TE graph helper hands to make_graphed_callables (the oracle)."""
    p2p = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                          virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    _, _, warmup, _ = schedules.get_pp_rank_microbatches(m, vpp, group, False, p2p_communicator=p2p)
    table = schedules.get_schedule_table(m, vpp, group)
    return cuda_graphs.convert_schedule_table_to_order(warmup, vpp, table)


def valid_grid():
    for pp in range(1, 9):
        for vpp in range(1, 5):
            if pp == 1 and vpp > 1:
                continue
            for m in sorted({1, 2, pp, pp + 1, 2 * pp, 2 * pp + 3, 3 * pp, 13}):
                groups = [None] if vpp == 1 else sorted({pp, pp + 1, 2 * pp, m})
                for group in groups:
                    if not schedule_problems(pp, 0, m, vpp, group):
                        yield pp, vpp, m, group


def test_order_equals_megatron_core_on_a_grid_every_rank():
    checked = 0
    for pp, vpp, m, group in valid_grid():
        for rank in range(pp):
            ours = pipeline_order(pp, rank, m, vpp, group)
            assert ours == megatron_order(pp, rank, m, vpp, group if group else pp), \
                (pp, rank, m, vpp, group)
            checked += 1
    assert checked > 1000  # the grid really covers many schedules, interleaved included


def test_plain_1f1b_warmup_is_pp_minus_rank_minus_one_capped_at_m():
    assert pipeline_order(4, 0, 8) == [1, 1, 1] + [1, -1] * 5 + [-1, -1, -1]
    assert pipeline_order(4, 3, 8) == [1, -1] * 8
    assert pipeline_order(4, 0, 2) == [1, 1, -1, -1]  # warmup 3 capped at M = 2
    assert pipeline_order(1, 0, 3) == [1, -1, 1, -1, 1, -1]


@pytest.mark.parametrize("args, broken", [
    (dict(pp_size=4, pp_rank=4, num_microbatches=8), "pp_rank: must be in [0, pp_size=4), got 4"),
    (dict(pp_size=4, pp_rank=-1, num_microbatches=8), "pp_rank: must be in [0, pp_size=4)"),
    (dict(pp_size=0, pp_rank=0, num_microbatches=8), "pp_size: must be a positive integer"),
    (dict(pp_size=2, pp_rank=0, num_microbatches=0), "num_microbatches: must be a positive integer"),
    (dict(pp_size=2, pp_rank=0, num_microbatches=4, vpp_size=0), "vpp_size: must be a positive"),
    (dict(pp_size=2, pp_rank=0, num_microbatches=4, vpp_size=2, microbatch_group_size=-1),
     "microbatch_group_size: must be a positive integer"),
    (dict(pp_size=1, pp_rank=0, num_microbatches=4, vpp_size=2), "need pp_size > 1"),
    (dict(pp_size=4, pp_rank=0, num_microbatches=8, vpp_size=2, microbatch_group_size=3),
     "microbatch_group_size: must be in [pp_size=4, num_microbatches=8]"),
    (dict(pp_size=4, pp_rank=0, num_microbatches=3, vpp_size=2),
     "must be in [pp_size=4, num_microbatches=3] with vpp_size > 1, got 4 (the default"),
    (dict(pp_size=4, pp_rank=0, num_microbatches=10, vpp_size=2),
     "num_microbatches: 10 % microbatch_group_size=4 = 2; the last group must be empty"),
])
def test_invalid_input_names_the_broken_rule(args, broken):
    with pytest.raises(ConfigError) as info:
        pipeline_order(**args)
    assert broken in str(info.value)


def test_all_problems_reported_together():
    problems = schedule_problems(0, 0, 0, vpp_size=0)
    assert [p.split(":")[0] for p in problems] == ["pp_size", "vpp_size", "num_microbatches"]


def test_check_order_rejects_backward_before_forward():
    pass_windows(decode_order(pipeline_order(4, 1, 8, 2)))
    with pytest.raises(ConfigError, match="entry 1 is the backward of chunk 2 microbatch 0"):
        pass_windows(decode_order([1, -2, 2, -1]))


@st.composite
def valid_schedules(draw):
    pp = draw(st.integers(1, 8))
    vpp = 1 if pp == 1 else draw(st.integers(1, 4))
    m = draw(st.integers(1 if vpp == 1 else pp, 40))
    group = None
    if vpp > 1:
        group = draw(st.integers(pp, m))
        if 0 < m % group < pp:
            group = m  # a single group always satisfies the remainder rule
    return pp, draw(st.integers(0, pp - 1)), m, vpp, group


@settings(max_examples=150, deadline=None)
@given(valid_schedules())
def test_every_pass_once_and_forward_before_backward(schedule):
    pp, rank, m, vpp, group = schedule
    order = pipeline_order(pp, rank, m, vpp, group)
    for chunk in range(1, vpp + 1):
        assert order.count(chunk) == m and order.count(-chunk) == m
    forward_at = {}
    for position, step in enumerate(decode_order(order)):
        key = (step.chunk, step.microbatch)
        if step.forward:
            forward_at[key] = position
        else:
            assert forward_at[key] < position


# -- mhc-cg schedule -------------------------------------------------------------------------------


def test_cli_json_has_the_per_rank_figures(capsys):
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--layers", "32",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    for rank in report["ranks"]:
        assert rank["order"] == pipeline_order(4, rank["rank"], 8, 2)
        assert rank["static_input_buffers"] < rank["static_input_buffers_no_reuse"]
        assert rank["persistent_slot_sets"] == rank["peak_in_flight"]
        for key in ("num_graphs", "arena_bytes", "persistent_bytes"):
            assert rank[key] > 0
    # Earlier ranks warm up longer, so they hold more microbatches in flight.
    peaks = [r["peak_in_flight"] for r in report["ranks"]]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]


def test_cli_reads_config_and_flags_override(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  num_layers: 8\n  hidden_size: 16\n  num_heads: 2\n"
                    "parallel:\n  pp_size: 2\n  vpp_size: 2\ntrain:\n  num_microbatches: 4\n")
    assert main(["schedule", "--config", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["pp"], report["vpp"], report["microbatches"], report["layers"]) == (2, 2, 4, 8)
    assert report["shape"]["hidden_size"] == 16
    assert main(["schedule", "--config", str(path), "--vpp", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][1]["order"] == [1, -1] * 4


def test_cli_bad_values_each_name_their_flag(capsys):
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "10", "--hidden", "0",
                 "--streams", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--microbatches: 10 % microbatch_group_size=4 = 2" in err
    assert "--hidden: must be a positive integer, got 0" in err
    assert "--streams: must be a positive integer, got -1" in err
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--layers", "30"]) == 2
    assert "--layers: must be a positive multiple of pp_size * vpp_size = 8" in capsys.readouterr().err


def test_cli_table_trace_and_png(tmp_path, capsys):
    trace, png = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["schedule", "--pp", "2", "--vpp", "2", "--microbatches", "4", "--layers", "8",
                 "--hidden", "64", "--seq", "128", "--trace", str(trace), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "order rank 1: " + " ".join(map(str, pipeline_order(2, 1, 4, 2))) in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"forward", "backward", "recompute"}
    assert all("slot_set" in e["args"] for e in spans)
    assert all(e["args"]["static_inputs"] for e in spans if e["cat"] != "recompute")


@settings(max_examples=25, deadline=None)
@given(valid_schedules())
def test_timeline_respects_pipeline_dependencies(schedule):
    pp, _, m, vpp, group = schedule
    plans = plan(pp, vpp, m, pp * vpp, group)
    timeline = simulate_timeline(plans)
    end = {}
    for rank, passes in enumerate(timeline):
        assert [p.index for p in passes] == list(range(len(plans[rank].order)))
        for before, after in zip(passes, passes[1:]):
            assert before.end <= after.start  # one pass at a time per rank
        for p in passes:
            end[("F" if p.forward else "B", (p.chunk - 1) * pp + rank, p.microbatch)] = (p.start, p.end)
    last = pp * vpp - 1
    for (kind, stage, mb), (start, _) in end.items():
        if kind == "F" and stage > 0:
            assert end[("F", stage - 1, mb)][1] <= start
        if kind == "B":
            assert end[("B", stage + 1, mb) if stage < last else ("F", stage, mb)][1] <= start
    assert len(chrome_trace(plans, timeline)["traceEvents"]) > 0


@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 4), (2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_recomputes_kept_counts_the_backwards_right_after_their_forward(pp, vpp, m):
    """Without VPP the last rank alternates one forward and its own backward (every microbatch
    keeps its last block); earlier ranks have a forward of another microbatch in between."""
    for rank in range(pp):
        order = pipeline_order(pp, rank, m, vpp)
        kept = recomputes_kept(order)
        pairs = sum(1 for a, b in zip(order, order[1:]) if a > 0 and b == -a)
        if vpp == 1:
            assert kept == (m if rank == pp - 1 else 0)
        assert kept <= pairs  # a chunk's +c then -c is the same microbatch only when it is its own
    assert recomputes_kept(pipeline_order(pp, pp - 1, m, vpp)) > 0
