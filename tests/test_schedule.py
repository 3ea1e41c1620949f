"""`pipeline_order`: Megatron's per-rank 1F1B / interleaved order, checked against megatron-core itself."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhc_cg.errors import ConfigError
from mhc_cg.schedule import check_order, decode_order, pipeline_order, schedule_problems

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
    check_order(pipeline_order(4, 1, 8, 2))
    with pytest.raises(ConfigError, match="entry 1 is the backward of chunk 2 microbatch 0"):
        check_order([1, -2, 2, -1])


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
