"""Static-buffer recompute along a real pipeline order (pp=4, vpp=2), on one process.

The rank's order (``mhc_cg.pipeline.schedule.pipeline_order``) is executed in sequence: ``+c`` runs the
forward of model chunk ``c`` on its next microbatch, ``-c`` that chunk's oldest backward. Many
microbatches are in flight at once, the two chunks share one arena and one pool of persistent
slot sets, and gradients must still equal eager without recompute, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from mhc_cg.recompute.arena import Arena
from mhc_cg.graphs import get_backend
from mhc_cg.model import MHCGPT, MHCGPTConfig
from mhc_cg.pipeline.schedule import pipeline_order
from mhc_cg.recompute.persistent import PersistentSetPool, new_persistent_set
from mhc_cg.recompute.static import build_static_recompute

SEQ, MBS, LAYERS_PER_CHUNK = 8, 2, 2


def rank_model() -> MHCGPT:
    """The layers one rank holds: two chunks of two layers."""
    torch.manual_seed(0)
    cfg = MHCGPTConfig(vocab_size=16, seq_length=SEQ, hidden_size=16, num_heads=2,
                       num_layers=2 * LAYERS_PER_CHUNK, hidden_dropout=0.25)
    return MHCGPT(cfg).train()


def peak_in_flight(order: list[int]) -> int:
    live = peak = 0
    for entry in order:
        live += 1 if entry > 0 else -1
        peak = max(peak, live)
    return peak


def execute(order, chunk_forward, width):
    """Run ``order``; return input grads per (chunk, microbatch) and the forward count."""
    g = torch.Generator().manual_seed(7)
    counts = {1: [0, 0], 2: [0, 0]}  # chunk -> [forwards, backwards]
    live, input_grads = {}, {}
    for entry in order:
        chunk = abs(entry)
        if entry > 0:
            mb = counts[chunk][0]
            counts[chunk][0] += 1
            x = torch.randn(SEQ, MBS, width, generator=g).requires_grad_()
            seed = torch.tensor(1000 * chunk + mb)
            live[(chunk, mb)] = (x, chunk_forward(chunk, x, seed))
        else:
            mb = counts[chunk][1]
            counts[chunk][1] += 1
            x, out = live.pop((chunk, mb))
            out.backward(torch.randn(out.shape, generator=g))
            input_grads[(chunk, mb)] = x.grad
    assert not live
    return input_grads


def chunk_layers(model, chunk):
    return list(model.layers)[(chunk - 1) * LAYERS_PER_CHUNK: chunk * LAYERS_PER_CHUNK]


def eager_run(order):
    model = rank_model()

    def forward(chunk, x, seed):
        for layer in chunk_layers(model, chunk):
            x = layer(x, seed)
        return x

    width = model.cfg.num_streams * model.cfg.hidden_size
    grads = execute(order, forward, width)
    return model, grads


def static_run(order, block_size, graphs: bool):
    model = rank_model()
    capacity = peak_in_flight(order)
    arena = Arena("cpu")
    sets = PersistentSetPool(capacity, lambda i: new_persistent_set(
        i, chunk_layers(model, 1), block_size, SEQ, MBS, "cpu"))
    runtimes = {c: build_static_recompute(chunk_layers(model, c), block_size, seq_length=SEQ,
                                          micro_batch_size=MBS, capacity=capacity, device="cpu",
                                          arena=arena, sets=sets) for c in (1, 2)}
    if graphs:
        backend = get_backend("tape")
        for rt in runtimes.values():
            rt.capture_recompute_graphs(backend)
    acquired = []
    original_acquire = sets.acquire

    def acquire():
        pset = original_acquire()
        acquired.append(pset.index)
        return pset

    sets.acquire = acquire
    width = model.cfg.num_streams * model.cfg.hidden_size
    grads = execute(order, lambda c, x, seed: runtimes[c].forward(x, seed), width)
    return model, grads, runtimes, acquired


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
    assert traces and all(line.endswith("(graph)") for line in traces)
    assert runtimes[1].sets.in_use == 0
    # FIFO along the order, exactly as the schedule planner assigns them
    try:
        from mhc_cg.pipeline.planner import assign_persistent_slot_sets
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
    from mhc_cg.modes.graphed_static import SlotSublayer
    from mhc_cg.graphs.graphed_callables import make_graphed_callables

    order = pipeline_order(4, 2, 4, vpp_size=2)
    ref_model, ref_grads = eager_run(order)
    model = rank_model()
    capacity = peak_in_flight(order)
    arena = Arena("cpu")
    sets = PersistentSetPool(capacity, lambda i: new_persistent_set(
        i, chunk_layers(model, 1), 1, SEQ, MBS, "cpu"))
    runtimes = {c: build_static_recompute(chunk_layers(model, c), 1, seq_length=SEQ,
                                          micro_batch_size=MBS, capacity=capacity, device="cpu",
                                          arena=arena, sets=sets) for c in (1, 2)}
    backend = get_backend("tape")
    for rt in runtimes.values():
        rt.capture_recompute_graphs(backend)
    modules, keys = [], []
    for c in (1, 2):
        for position, layer in enumerate(chunk_layers(model, c)):
            for k, sub in enumerate((layer.attention, layer.mlp)):
                modules.append(SlotSublayer(runtimes[c], sub, 0, k))  # block size 1: position 0
                keys.append((layer.layer_number, k))
    per_chunk = 2 * LAYERS_PER_CHUNK
    microbatches = len(order) // 4
    width = model.cfg.num_streams * model.cfg.hidden_size
    sample_args = [(torch.zeros(SEQ, MBS, width, requires_grad=True),
                    torch.zeros((), dtype=torch.int64))
                   for _ in range(2 * microbatches * per_chunk)]
    graphed = make_graphed_callables(tuple(modules), sample_args, order=order,
                                     num_layers_per_chunk=per_chunk, backend=backend)

    def forward(chunk, x, seed, counts={1: 0, 2: 0}):
        mb = counts[chunk]
        counts[chunk] += 1
        first = (chunk - 1) * microbatches * per_chunk + mb * per_chunk
        fns = {keys[(chunk - 1) * per_chunk + j]: graphed[first + j] for j in range(per_chunk)}
        return runtimes[chunk].forward(x, seed, fns)

    grads = execute(order, forward, width)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        if ref_params[name].grad is not None:
            assert torch.equal(p.grad, ref_params[name].grad), name
    assert sets.in_use == 0 and arena.nbytes == runtimes[2].arena.nbytes
    assert all(g.stats.violations == 0 for g in graphed.graphs())
