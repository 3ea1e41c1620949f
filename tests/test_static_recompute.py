"""Static-buffer recompute (eager, no graphs): gradients bit-identical to no recompute."""

from __future__ import annotations

import functools
import pytest
import torch
import torch.nn.functional as F

from mhc_cg.runtime.arena import ArenaLayoutError
from mhc_cg.model import MHCGPT, MHCGPTConfig
from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.runtime.static import SublayerGraph, build_static_recompute

SEQ, MBS = 16, 2


def tiny_model(num_layers: int = 4, dropout: float = 0.2, impl: str = "counter",
               num_experts: int | None = None) -> MHCGPT:
    torch.manual_seed(0)
    cfg = MHCGPTConfig(vocab_size=32, seq_length=SEQ, hidden_size=32, num_heads=4,
                       num_layers=num_layers, hidden_dropout=dropout, dropout_impl=impl,
                       num_experts=num_experts, moe_top_k=2, moe_ffn_hidden_size=48)
    return MHCGPT(cfg).train()


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 32, (MBS, SEQ), generator=g), torch.randint(0, 32, (MBS, SEQ), generator=g),
             torch.tensor(100 + i)) for i in range(n)]


def loss_of(model, logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference_grads(model, data):
    """Eager, no recompute; backward in the same FIFO order as the runs under test."""
    model.zero_grad(set_to_none=True)
    losses = [loss_of(model, model(ids, seed), tgt) for ids, tgt, seed in data]
    for loss in losses:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def static_grads(model, runtime, data):
    model.zero_grad(set_to_none=True)
    losses = [loss_of(model, model.logits(runtime.forward(model.embed(ids), seed)), tgt)
              for ids, tgt, seed in data]
    for loss in losses:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("block_size,num_experts", [(1, None), (2, None), (3, None), (4, None),
                                                    (2, 4)])
def test_gradients_bit_identical_with_microbatches_in_flight(block_size, num_experts):
    model, data = tiny_model(num_experts=num_experts), batches(3)
    expected = reference_grads(model, data)
    runtime = build_static_recompute(list(model.layers), block_size, seq_length=SEQ,
                                     micro_batch_size=MBS, capacity=3, device="cpu")
    got = static_grads(model, runtime, data)
    assert all(torch.equal(got[n], expected[n]) for n in expected), \
        [n for n in expected if not torch.equal(got[n], expected[n])]
    # every block of every microbatch was recomputed exactly once, last block first: with three
    # forwards before the first backward, none found its last block still in the arena
    assert len(runtime.trace) == 3 * runtime.layout.num_blocks
    assert runtime.trace[0].startswith(f"recompute block {runtime.layout.num_blocks - 1} set 0")
    assert not any(how == "kept" for _, how in runtime.recomputes)
    assert runtime.sets.in_use == 0


def test_without_the_recompute_the_shared_arena_gives_wrong_gradients():
    """Negative control: the arena really is overwritten by later microbatches."""
    model, data = tiny_model(), batches(2)
    expected = reference_grads(model, data)
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=2, device="cpu")
    runtime.run_recompute = lambda block, pset: None
    got = static_grads(model, runtime, data)
    assert not all(torch.equal(got[n], expected[n]) for n in expected)


def interleaved_grads(model, data, forward, between=None):
    """Each microbatch's forward, then its backward (no pipeline): ``between`` runs in between."""
    model.zero_grad(set_to_none=True)
    for ids, tgt, seed in data:
        loss = loss_of(model, model.logits(forward(model.embed(ids), seed)), tgt)
        if between is not None:
            between()
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("block_size", [1, 3])
def test_a_backward_right_after_its_forward_keeps_the_last_blocks_slots(block_size):
    """No recompute of the last block where nothing wrote the arena since its forward; the
    gradients are still eager's, bit for bit."""
    model, data = tiny_model(), batches(3)
    expected = interleaved_grads(model, data, model.run_layers)
    runtime = build_static_recompute(list(model.layers), block_size, seq_length=SEQ,
                                     micro_batch_size=MBS, capacity=1, device="cpu")
    got = interleaved_grads(model, data, runtime.forward)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    last = runtime.layout.num_blocks - 1
    assert runtime.recomputes[(last, "kept")] == 3 and runtime.recomputes[(last, "eager")] == 0
    assert all(runtime.recomputes[(b, "eager")] == 3 for b in range(last))


def test_a_write_into_the_arena_after_the_forward_brings_the_recompute_back():
    """A borrower of the arena (the optimizer's workspace) writes it between a forward and its
    backward: the last block is recomputed, and the gradients stay eager's."""
    model, data = tiny_model(), batches(2)
    expected = interleaved_grads(model, data, model.run_layers)
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ,
                                     micro_batch_size=MBS, capacity=1, device="cpu")
    got = interleaved_grads(model, data, runtime.forward,
                            between=lambda: runtime.arena.borrow().fill_(7))
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert runtime.recomputes[(runtime.layout.num_blocks - 1, "eager")] == 2
    assert not any(how == "kept" for _, how in runtime.recomputes)


def test_slot_addresses_and_arena_size_fixed_across_steps():
    model, data = tiny_model(), batches(2)
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=2, device="cpu")
    arena_bytes = runtime.arena.nbytes
    static_grads(model, runtime, data)
    ptrs = runtime.arena.data_ptrs()
    set_ptrs = [s.data_ptrs() for s in runtime.sets.all_sets()]
    for _ in range(3):
        static_grads(model, runtime, data)
    assert runtime.arena.data_ptrs() == ptrs and len(ptrs) > 0
    assert [s.data_ptrs() for s in runtime.sets.all_sets()] == set_ptrs
    assert runtime.arena.nbytes == arena_bytes


def test_arena_is_one_block_whatever_the_number_of_blocks():
    sizes = {}
    for layers in (2, 4, 6):
        model = tiny_model(num_layers=layers)
        runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ,
                                         micro_batch_size=MBS, capacity=1, device="cpu")
        sizes[layers] = runtime.arena.nbytes
    assert len(set(sizes.values())) == 1, sizes


def test_second_backward_through_a_block_is_an_error():
    model, (ids, tgt, seed) = tiny_model(), batches(1)[0]
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=1, device="cpu")
    loss = loss_of(model, model.logits(runtime.forward(model.embed(ids), seed)), tgt)
    loss.backward(retain_graph=True)
    with pytest.raises(StaticRecomputeError, match="second backward"):
        loss.backward()


def test_more_microbatches_in_flight_than_sets_is_an_error():
    model, data = tiny_model(), batches(2)
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=1, device="cpu")
    runtime.forward(model.embed(data[0][0]), data[0][2])
    with pytest.raises(StaticRecomputeError, match="more than 1 microbatches in flight"):
        runtime.forward(model.embed(data[1][0]), data[1][2])


def test_stateful_dropout_is_rejected_with_the_reason():
    model = tiny_model(impl="torch")
    with pytest.raises(StaticRecomputeError, match="cannot rewind"):
        build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                               capacity=1, device="cpu")


def test_a_shape_other_than_the_layout_is_an_error_not_a_reallocation():
    model = tiny_model()
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=1, device="cpu")
    ids = torch.randint(0, 32, (MBS + 1, SEQ))
    with pytest.raises(StaticRecomputeError, match="laid out for"):
        runtime.forward(model.embed(ids), torch.tensor(1))


def test_exception_mid_forward_claims_nothing_and_next_step_is_correct():
    model, data = tiny_model(), batches(1)
    expected = reference_grads(model, data)
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=1, device="cpu")

    class Boom(Exception):
        pass

    def explode(x, seed):
        raise Boom()

    attention_of_layer_3 = runtime.layout.layer_records(3)[0]
    with pytest.raises(Boom):
        runtime.forward(model.embed(data[0][0]), data[0][2],
                        sublayer_fns={attention_of_layer_3.order: SublayerGraph(explode)})
    assert runtime.sets.in_use == 0
    got = static_grads(model, runtime, data)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_arena_layout_is_fixed_once_allocated():
    from mhc_cg.runtime.arena import Arena
    arena = Arena("cpu")
    region = arena.region("L0.attn.0")
    arena.claim(region, 0, 256, torch.float32)
    arena.allocate()
    slot = arena.claim(region, 0, 256, torch.float32)
    arena.write(region, 0, slot, torch.arange(64, dtype=torch.float32))
    assert torch.equal(arena.reader(slot), torch.arange(64, dtype=torch.float32))
    with pytest.raises(ArenaLayoutError, match="got 512 bytes"):
        arena.claim(region, 0, 512, torch.float32)
    with pytest.raises(ArenaLayoutError, match="layout has 1 slots"):
        arena.claim(region, 1, 256, torch.float32)
    with pytest.raises(ArenaLayoutError, match="not seen before"):
        arena.region("L9.mlp.0")


def test_moe_partial_capture_signal_unwinding_the_forward_leaves_nothing_claimed():
    from mhc_cg.model.moe import MoECudaGraphPartialCaptureSignal

    model, data = tiny_model(num_experts=4), batches(1)
    expected = reference_grads(model, data)
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=1, device="cpu")
    moe = model.layers[2].mlp.fn
    x = model.embed(data[0][0])
    with pytest.MonkeyPatch.context() as patch:  # as if a capture were running: it signals
        patch.setattr(moe, "forward", functools.partial(type(moe).forward, moe,
                                                        partial_capture="route"))
        with pytest.raises(MoECudaGraphPartialCaptureSignal):
            runtime.forward(x, data[0][2])
    assert runtime.sets.in_use == 0
    got = static_grads(model, runtime, data)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


@pytest.mark.parametrize("block_size,dropout", [(1, 0.2), (2, 0.2), (2, 0.0)])
def test_arena_holds_one_block_of_what_the_backward_reads(block_size, dropout):
    """The arena is what the backward reads of one block besides the persistent set, nothing
    more: each sublayer's stream input but the block's first (saved from the set), and each F
    input: (2L - 1) n C + 2L C per token (analytical.arena_elements), up to alignment."""
    from mhc_cg.runtime.arena import ALIGN_BYTES
    from mhc_cg.lab.memory.analytical import arena_elements

    model = tiny_model(dropout=dropout)
    runtime = build_static_recompute(list(model.layers), block_size, seq_length=SEQ,
                                     micro_batch_size=MBS, capacity=1, device="cpu")
    cfg = model.cfg
    expected = arena_elements(cfg.num_streams, cfg.hidden_size, block_size) * SEQ * MBS * 4
    slots = sum(len(r.slots) for r in runtime.arena.regions.values())
    assert expected <= runtime.arena.nbytes <= expected + slots * ALIGN_BYTES
