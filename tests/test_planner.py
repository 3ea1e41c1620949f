"""Static-buffer planner: TE-style input reuse, FIFO persistent slot sets, conflicts, bytes."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mhc_cg.core.errors import ConfigError
from mhc_cg.model import MHCGPTConfig, MHCTransformerLayer
from mhc_cg.lab.planning.planner import (ModelShape, assign_persistent_slot_sets, count_static_input_buffers,
                            first_conflict, max_persistent_slot_sets, peak_in_flight, plan,
                            plan_order, plan_rank, static_input_uses)
from mhc_cg.core.pipeline_order import pipeline_order, schedule_problems
from mhc_cg.runtime.persistent import PersistentSetPool, new_persistent_set

SMALL = ModelShape(hidden_size=8, seq_length=4, micro_batch_size=2, num_streams=4, dtype="fp32")


def test_1f1b_reuses_one_set_of_inputs_all_forwards_first_reuses_none():
    # Two schedules: forward-then-backward per microbatch versus all forwards first.
    one_f_one_b, all_forwards_first = [1, -1] * 4, [1] * 4 + [-1] * 4
    assert count_static_input_buffers(one_f_one_b, 3) == 3
    assert count_static_input_buffers(one_f_one_b, 3, reuse=False) == 12
    assert count_static_input_buffers(all_forwards_first, 3) == 12
    assert max_persistent_slot_sets(one_f_one_b) == 1
    assert max_persistent_slot_sets(all_forwards_first) == 4


def test_reuse_takes_buffers_freed_by_the_chunks_oldest_forward():
    order = [1, 2, -2, 1, -1, -1]  # chunk 1 has 1 layer, chunk 2 has 2
    uses = static_input_uses(order, [1, 2])
    by_pass = {}
    for use in uses:
        by_pass.setdefault((use.chunk, use.microbatch), []).append(use.buffer)
    # -2 frees chunk 2's buffers 1 and 2; the second forward of chunk 1 takes the older one.
    assert by_pass == {(1, 0): [0], (2, 0): [1, 2], (1, 1): [1]}
    assert count_static_input_buffers(order, [1, 2]) == 3


def test_slot_sets_are_handed_out_first_in_first_out():
    order = [1, 1, 1, -1, 1, -1, 1, -1, -1, -1]
    assert assign_persistent_slot_sets(order) == [0, 1, 2, 0, 1]


def test_bad_orders_and_layer_counts_are_clear_errors():
    with pytest.raises(ConfigError, match="entry 1 is the backward of chunk 2 microbatch 0"):
        assign_persistent_slot_sets([1, -2, 2, -1])
    with pytest.raises(ConfigError, match="chunk 1 microbatch 1 has a forward but no backward"):
        count_static_input_buffers([1, -1, 1], 2)
    with pytest.raises(ConfigError, match="num_layers_per_chunk: need a positive layer count"):
        count_static_input_buffers([1, 2, -2, -1], [3])
    with pytest.raises(ConfigError, match="num_layers: must be a positive multiple of pp_size "
                                          r"\* vpp_size = 8, got 30"):
        plan(4, 2, 8, 30)
    with pytest.raises(ConfigError) as info:
        ModelShape(hidden_size=0, dtype="int8")
    assert [p.split(":")[0] for p in info.value.problems] == ["hidden_size", "dtype"]


def test_a_shared_buffer_with_overlapping_users_is_reported():
    rank_plan = plan_rank(4, 0, 8, 16, vpp_size=2, shape=SMALL)
    assert rank_plan.conflict is None
    squeezed = [dataclasses.replace(u, buffer=0) if u.kind == "persistent_set" else u
                for u in rank_plan.uses]  # as if the rank had a single slot set
    conflict = first_conflict(squeezed)
    assert conflict is not None and conflict.first.kind == "persistent_set"
    assert conflict.second.start <= conflict.first.end
    backwards_of_chunk_1 = [i for i, code in enumerate(rank_plan.order) if code == -1]
    # The second forward (chunk 1, microbatch 1) overwrites the set while microbatch 0 of chunk 1
    # still waits for its backward (the first -1; microbatch 1's is the second).
    assert (conflict.first.chunk, conflict.first.microbatch) == (1, 0)
    assert (conflict.second.chunk, conflict.second.microbatch) == (1, 1)
    assert str(conflict) == (f"persistent_set buffer 0: chunk 1 microbatch 1 [order 1 .. "
                             f"{backwards_of_chunk_1[1]}] writes it while chunk 1 microbatch 0 "
                             f"[order 0 .. {backwards_of_chunk_1[0]}] still needs it")


def test_persistent_bytes_match_the_runtime_slot_sets():
    cfg = MHCGPTConfig(hidden_size=8, num_heads=2, num_layers=5, seq_length=4, num_streams=4)
    layers = [MHCTransformerLayer(cfg, i) for i in range(5)]
    shape = dataclasses.replace(SMALL, recompute_layers=2)  # blocks of 2, 2, 1 layers
    real = new_persistent_set(0, layers, 2, shape.seq_length, shape.micro_batch_size, "cpu",
                              torch.float32)
    assert shape.persistent_set_bytes(5) == real.nbytes


def test_bytes_scale_with_the_buffer_counts():
    rank_plan = plan_rank(2, 0, 6, 8, shape=SMALL)
    assert rank_plan.static_input_bytes == rank_plan.static_input_buffers * 4 * 2 * 4 * 8 * 4
    assert rank_plan.persistent_bytes == rank_plan.persistent_slot_sets * \
        SMALL.persistent_set_bytes(rank_plan.layers_per_chunk)
    assert rank_plan.arena_bytes == SMALL.arena_bytes(4)


@st.composite
def valid_schedules(draw, max_m=24):
    pp = draw(st.integers(1, 6))
    vpp = 1 if pp == 1 else draw(st.integers(1, 3))
    group = pp if vpp == 1 else draw(st.integers(pp, 2 * pp))
    low = 1 if vpp == 1 else group
    m = draw(st.integers(low, max(low, max_m)))
    if schedule_problems(pp, 0, m, vpp, group):
        m = group  # one full group always satisfies every rule
    return pp, draw(st.integers(0, pp - 1)), m, vpp, group


@settings(max_examples=60, deadline=None)
@given(valid_schedules(), st.integers(1, 3))
def test_no_buffer_has_overlapping_users(schedule, layers_per_chunk):
    pp, rank, m, vpp, group = schedule
    rank_plan = plan_rank(pp, rank, m, pp * vpp * layers_per_chunk, vpp, group, SMALL)
    assert rank_plan.conflict is None
    assert rank_plan.persistent_slot_sets == rank_plan.peak_in_flight
    assert rank_plan.static_input_buffers == rank_plan.peak_in_flight * layers_per_chunk
    assert rank_plan.static_input_buffers_no_reuse == m * vpp * layers_per_chunk


@settings(max_examples=60, deadline=None)
@given(valid_schedules())
def test_slot_set_assignment_is_what_the_runtime_pool_hands_out(schedule):
    order = pipeline_order(*schedule)
    pool = PersistentSetPool(max_persistent_slot_sets(order), lambda i: type("S", (), {"index": i}))
    held, handed_out = {}, []
    for position, code in enumerate(order):
        key = (abs(code), order[:position].count(code))
        if code > 0:
            held[key] = pool.acquire()
            handed_out.append(held[key].index)
        else:
            pool.release(held.pop(key))
    assert handed_out == assign_persistent_slot_sets(order)


@settings(max_examples=40, deadline=None)
@given(valid_schedules(max_m=1))
def test_buffer_counts_stop_growing_with_m_while_graphs_grow(schedule):
    pp, rank, _, vpp, group = schedule
    plans = [plan_rank(pp, rank, k * group, 2 * pp * vpp, vpp, group, SMALL) for k in (2, 3, 5)]
    for counted in ("static_input_buffers", "persistent_slot_sets", "arena_bytes"):
        assert len({getattr(p, counted) for p in plans}) == 1, counted
    for p, k in zip(plans, (2, 3, 5)):
        assert p.num_graphs == k * group * vpp * 2
        assert p.static_input_buffers_no_reuse == p.num_graphs


def test_peak_in_flight_is_warmup_plus_one_when_the_pipeline_fills():
    for rank in range(4):
        order = pipeline_order(4, rank, 16, 2)
        assert peak_in_flight(order) == 2 * (4 - rank - 1) + 4 + 1


def test_plan_order_accepts_any_valid_order():
    rank_plan = plan_order(0, [1, 1, -1, 1, -1, -1], 2, SMALL)
    assert (rank_plan.static_input_buffers, rank_plan.persistent_slot_sets) == (4, 2)
    assert rank_plan.slot_set_of_forward == [0, 1, 0]
