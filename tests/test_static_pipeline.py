"""Static-buffer recompute along a real pipeline order (pp=4, vpp=2), on one process.

The rank's order (``mhc_cg.core.pipeline_order.pipeline_order``) is executed in sequence: ``+c`` runs the
forward of model chunk ``c`` on its next microbatch, ``-c`` that chunk's oldest backward. Many
microbatches are in flight at once, the two chunks share one arena and one pool of persistent
slot sets, and gradients must still equal eager without recompute, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from mhc_cg.runtime.arena import Arena
from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.core.pipeline_order import peak_in_flight, pipeline_order, recomputes_kept
from mhc_cg.runtime.persistent import PersistentSetPool, new_persistent_set
from mhc_cg.runtime.static import build_static_recompute

from helpers import (PIPELINE_LAYERS_PER_CHUNK, PIPELINE_MBS, PIPELINE_SEQ, chunk_layers, eager_run,
                     execute, rank_model, static_run)


@pytest.mark.parametrize("rank", [0, 3])
def test_pipeline_order_gradients_bit_identical_with_recompute_graphs(rank):
    order = pipeline_order(4, rank, 8, vpp_size=2)
    ref_model, ref_grads = eager_run(order)
    model, grads, runtimes, acquired = static_run(order, block_size=1, graphs=True)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        if ref_params[name].grad is not None:
            assert torch.equal(p.grad, ref_params[name].grad), name
    traces = [line for rt in runtimes.values() for line in rt.trace]
    kept = [line for line in traces if line.endswith("(kept from the forward)")]
    assert traces and all(line.endswith("(graph)") for line in traces if line not in kept)
    # a chunk's last block is not recomputed where its backward directly follows its forward
    assert len(kept) == recomputes_kept(order) == (8 if rank == 3 else 0)
    assert all(line.startswith(f"recompute block {PIPELINE_LAYERS_PER_CHUNK - 1} ")
               for line in kept)
    assert runtimes[1].sets.in_use == 0
    # FIFO along the order, exactly as the schedule planner assigns them
    try:
        from mhc_cg.core.pipeline_order import assign_persistent_slot_sets
    except ImportError:
        return
    assert acquired == assign_persistent_slot_sets(order)


def test_arena_and_sets_do_not_grow_with_microbatches():
    sizes = {}
    for m in (4, 8, 32):
        order = pipeline_order(4, 0, m, vpp_size=2)
        _, _, runtimes, _ = static_run(order, block_size=2, graphs=False)
        rt = runtimes[1]
        sizes[m] = (rt.arena.nbytes, rt.sets.capacity, rt.sets.nbytes_per_set)
    arenas = {s[0] for s in sizes.values()}
    assert len(arenas) == 1, sizes
    # persistent sets: bounded by the schedule's warm-up, not by M
    assert sizes[8][1] == sizes[32][1], sizes
    assert sizes[4][2] == sizes[32][2]


def test_graphed_sublayers_per_microbatch_along_the_order():
    """The full picture on one rank: every sublayer a graphed callable per (chunk, microbatch,
    layer), captured with the order (TE semantics, shared pool, static input reuse), the mHC ops
    inside them saving into the shared arena, recompute graphs per (chunk, block, set)."""
    from mhc_cg.runtime.graphable import graphable_sublayers
    from mhc_cg.runtime.static import SublayerGraph
    from mhc_cg.runtime.recompute_captures import capture_recompute_graphs
    from mhc_cg.graphs.graphed_callables import GraphOptions, make_graphed_callables

    order = pipeline_order(4, 2, 4, vpp_size=2)
    ref_model, ref_grads = eager_run(order)
    model = rank_model()
    capacity = peak_in_flight(order)
    arena = Arena("cpu")
    sets = PersistentSetPool(capacity, lambda i: new_persistent_set(
        i, chunk_layers(model, 1), 1, PIPELINE_SEQ, PIPELINE_MBS, "cpu"))
    runtimes = {c: build_static_recompute(chunk_layers(model, c), 1, seq_length=PIPELINE_SEQ,
                                          micro_batch_size=PIPELINE_MBS, capacity=capacity, device="cpu",
                                          arena=arena, sets=sets) for c in (1, 2)}
    backend = get_backend("tape")
    for rt in runtimes.values():
        rt.recompute_graphs.update(capture_recompute_graphs(rt, backend))
    modules, orders = [], []
    for c in (1, 2):
        chunk_modules, records = graphable_sublayers(runtimes[c], attn=True, mlp=True,
                                                     moe_step=None)
        modules += chunk_modules
        orders += [record.order for record in records]
    per_chunk = 2 * PIPELINE_LAYERS_PER_CHUNK
    microbatches = len(order) // 4
    width = model.cfg.num_streams * model.cfg.hidden_size
    sample_args = [(torch.zeros(PIPELINE_SEQ, PIPELINE_MBS, width, requires_grad=True),
                    torch.zeros((), dtype=torch.int64))
                   for _ in range(2 * microbatches * per_chunk)]
    graphed = make_graphed_callables(tuple(modules), sample_args, _order=order,
                                     _reuse_graph_input_output_buffers=True,
                                     _num_layers_per_chunk=per_chunk,
                                     options=GraphOptions(backend=backend, grads_owned=True))

    def forward(chunk, x, seed, counts={1: 0, 2: 0}):
        mb = counts[chunk]
        counts[chunk] += 1
        first = (chunk - 1) * microbatches * per_chunk + mb * per_chunk
        fns = {orders[(chunk - 1) * per_chunk + j]: SublayerGraph(graphed[first + j], named=False)
               for j in range(per_chunk)}
        return runtimes[chunk].forward(x, seed, fns)

    grads = execute(order, forward, width)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        if ref_params[name].grad is not None:
            assert torch.equal(p.grad, ref_params[name].grad), name
    assert sets.in_use == 0 and arena.nbytes == runtimes[2].arena.nbytes
    assert all(g.stats.violations == 0 for g in graphed.graphs())


@pytest.mark.parametrize("rank", [0, 1])
def test_every_step_takes_the_sets_the_captures_were_bound_to(rank):
    """A graph captured for microbatch k writes the set k takes along the order: the pool must
    hand out the same sets in every step, not only the first (the release order of an
    interleaved schedule is not the acquire order)."""
    from types import SimpleNamespace

    from mhc_cg.core.pipeline_order import assign_persistent_slot_sets, decode_order, max_persistent_slot_sets

    order = pipeline_order(2, rank, 4, vpp_size=2)
    pool = PersistentSetPool(max_persistent_slot_sets(order), lambda i: SimpleNamespace(index=i))
    for _ in range(3):
        held, taken = {}, []
        for step in decode_order(order):
            key = (step.chunk, step.microbatch)
            if step.forward:
                held[key] = pool.acquire()
                taken.append(held[key].index)
            else:
                pool.release(held.pop(key))
        assert taken == assign_persistent_slot_sets(order)
