"""Graphed static-buffer recompute through the ``tape`` backend, in the training loop.

Each scope set trains five steps and is compared with eager without recompute: losses and every
parameter gradient of every step must be bit-identical (dropout on, two microbatches per step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc

import pytest
import torch

from mhc_cg.lab.planning.planner import ModelShape
from mhc_cg.lab.compare.watch import grad_digest
from mhc_cg.training.data import ProgressionCorpus
from helpers import build_for_mode

from helpers import SCOPE_CASES, assert_training_identical, grads_per_step, small_config


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_bytes_in_use() -> int:
    """Bytes malloc has handed out and not got back (glibc ``mallinfo2``): torch's CPU tensors
    come from malloc, Python's small objects do not (pymalloc maps its own arenas)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc >= 2.33 (mallinfo2) needed to read the heap")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.parametrize("case", list(SCOPE_CASES))
def test_five_steps_bit_identical_to_eager_without_recompute(case):
    scopes, experts = SCOPE_CASES[case]
    cfg = small_config(scopes, experts)
    graphed = assert_training_identical(cfg, "graphed_static", 5)
    # two blocks of two layers, one slot set; with every sublayer a graph the recompute graphs
    # join the sublayer pool at their fixed replay point, and the last block, which each
    # backward finds still in the arena, gets none
    assert graphed.info["recompute_graphs"] == (1 if case == "attn_mlp" else 2)
    assert graphed.losses[-1] < graphed.losses[0]


def test_static_addresses_no_capture_violations_no_memory_growth():
    """Slots never move, no capture resized or re-pointed anything, steps 2..50 allocate nothing
    that outlives them."""
    import torch.nn.functional as F

    cfg = small_config(["attn", "mlp", "mhc_recompute"])
    graphed = build_for_mode(cfg, "graphed_static", torch.device("cpu"))
    model, forward = graphed.model, graphed
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    seq, mbs = cfg.model.seq_length, cfg.train.micro_batch_size

    def step():
        optimizer.zero_grad(set_to_none=True)
        for _ in range(2):
            ids = torch.randint(0, 32, (mbs, seq), generator=g)
            seed = torch.randint(0, 2 ** 31 - 1, (), generator=g)
            F.cross_entropy(forward(ids, seed).flatten(0, 1), ids.flatten()).backward()
        optimizer.step()

    rt = graphed.runtime
    step()
    step()
    arena_ptrs = rt.arena.data_ptrs()
    set_ptrs = [s.data_ptrs() for s in rt.sets.all_sets()]
    gc.collect()
    after_step_2 = heap_bytes_in_use()
    for _ in range(48):
        step()
    gc.collect()
    growth = heap_bytes_in_use() - after_step_2
    assert rt.arena.data_ptrs() == arena_ptrs
    assert [s.data_ptrs() for s in rt.sets.all_sets()] == set_ptrs
    reports = [graph.stats for graph in graphed.graphs()]
    assert len(reports) == len(graphed.graphs()) > 0
    assert all(r.violations == 0 and r.ops_replayed > 0 for r in reports)
    # one microbatch of this model keeps ~100 KiB of activations: a leak of one tensor per step
    # would show as several times that after 48 steps
    assert growth < 64 * 1024, f"the C heap grew by {growth} bytes from step 2 to step 50"


def test_persistent_bytes_per_microbatch_match_the_planner():
    cfg = small_config(["attn", "mhc_recompute"])
    graphed = build_for_mode(cfg, "graphed_static", torch.device("cpu"))
    m = cfg.model
    shape = ModelShape(hidden_size=m.hidden_size, seq_length=m.seq_length,
                       micro_batch_size=cfg.train.micro_batch_size, num_streams=m.num_streams,
                       dtype="fp32", recompute_layers=m.recompute_layers)
    assert graphed.runtime.sets.nbytes_per_set == shape.persistent_set_bytes(m.num_layers)


def test_bf16_graphed_static_bit_identical_to_eager_bf16():
    """train.dtype bf16: parameters, activations and every slot in bf16, still bit for bit."""
    cfg = small_config(["attn", "mlp", "mhc_recompute"])
    cfg.train = dataclasses.replace(cfg.train, dtype="bf16")
    reference, ref_grads = grads_per_step(cfg, "eager_none", 3)
    graphed, got_grads = grads_per_step(cfg, "graphed_static", 3)
    assert graphed.losses == reference.losses
    for want, got in zip(ref_grads, got_grads):
        assert all(got[n].dtype == torch.bfloat16 and torch.equal(want[n], got[n]) for n in want)
    fp32 = build_for_mode(small_config(["attn", "mlp", "mhc_recompute"]), "graphed_static",
                          torch.device("cpu"))
    # same layout: every floating slot holds half the bytes; the dropout seeds (int64) do not shrink
    bf16 = build_for_mode(cfg, "graphed_static", torch.device("cpu"))
    assert graphed.info["arena_bytes"] == bf16.runtime.arena.nbytes
    bf16_slots = [sl for r in bf16.runtime.arena.regions.values() for sl in r.slots]
    fp32_slots = [sl for r in fp32.runtime.arena.regions.values() for sl in r.slots]
    assert [sl.dtype for sl in bf16_slots] == [
        torch.bfloat16 if sl.dtype == torch.float32 else sl.dtype for sl in fp32_slots]
    assert [sl.nbytes * (2 if sl.dtype == torch.bfloat16 else 1) for sl in bf16_slots] == [
        sl.nbytes for sl in fp32_slots]


def test_graphed_sublayers_with_several_microbatches_in_flight_are_refused():
    from mhc_cg.core.errors import StaticRecomputeError
    from mhc_cg.model import MHCGPT
    from mhc_cg.modes.graphed_static import GraphedStaticModel
    from mhc_cg.lab.resolve import resolve

    cfg = small_config(["attn", "mhc_recompute"])
    with pytest.raises(StaticRecomputeError, match="order=pipeline_order"):
        GraphedStaticModel(MHCGPT(cfg.model), resolve(cfg, device="cpu").plan, micro_batch_size=4,
                           capacity=2)
    # the recompute graphs alone are per slot set: any number in flight
    recompute_only = small_config(["mhc_recompute"])
    GraphedStaticModel(MHCGPT(cfg.model), resolve(recompute_only, device="cpu").plan,
                       micro_batch_size=4, capacity=2)


def test_persistent_bytes_with_activation_recompute_match_the_planner():
    cfg = small_config(["attn", "mhc_recompute"])
    cfg.model = dataclasses.replace(cfg.model, recompute_activation=True,
                                    recompute_activation_layers=3)
    graphed = build_for_mode(cfg, "graphed_static", torch.device("cpu"))
    m = cfg.model
    shape = ModelShape(hidden_size=m.hidden_size, seq_length=m.seq_length,
                       micro_batch_size=cfg.train.micro_batch_size, num_streams=m.num_streams,
                       dtype="fp32", recompute_layers=m.recompute_layers,
                       activation_recompute_layers=3, ffn_hidden_size=m.ffn_hidden_size)
    assert graphed.runtime.sets.nbytes_per_set == shape.persistent_set_bytes(m.num_layers)


@pytest.mark.parametrize("case", ["attn_mlp", "moe_partial"])
def test_the_arena_is_idle_wherever_it_is_lent(case):
    """The arena is lent outside the blocks' windows (the embeddings' gradient after block 0's
    backward, the optimizer's staging bucket): filled with NaN before every microbatch's forward
    and before every optimizer step, bf16 training is still bit-identical to eager without
    recompute, so nothing reads a slot there before writing it. The lending is live: the
    optimizer allocates no bucket of its own, and its last cast gradients are found in the arena
    after a step."""
    from mhc_cg.lab.resolve import resolve
    from mhc_cg.training.optimizer import MainParamAdamW
    from mhc_cg.training.session import TrainSession

    cfg = small_config(*SCOPE_CASES[case])
    cfg.train = dataclasses.replace(cfg.train, dtype="bf16")
    cpu = torch.device("cpu")

    def small_buckets(cfg, params):  # a bucket the small arena holds
        return MainParamAdamW(params, lr=cfg.train.lr, weight_decay=0.0,
                              model_dtype=torch.bfloat16, bucket_bytes=4096)

    sessions = {mode: TrainSession.build(resolve(cfg, mode, cpu), optimizer=small_buckets)
                for mode in ("eager_none", "graphed_static")}
    assert sessions["graphed_static"].optimizer.staging is None
    graphed = sessions["graphed_static"].mode_model
    arena = graphed.runtime.arena
    microbatch_loss = graphed.microbatch_loss

    def poisoned_microbatch(*args):
        arena.borrow().fill_(255)  # 0xff..: NaN in every float dtype
        return microbatch_loss(*args)

    graphed.microbatch_loss = poisoned_microbatch
    for step in range(3):
        digests = {}

        def poison_after_digest(model, mode):
            digests[mode] = grad_digest(model)
            arena.borrow().fill_(255)

        losses = {mode: s.step(after_backward=lambda model, m=mode: poison_after_digest(model, m))[0]
                  for mode, s in sessions.items()}
        assert losses["graphed_static"] == losses["eager_none"], step
        assert digests["graphed_static"] == digests["eager_none"], step
        assert (arena.borrow() != 255).any()  # the step's cast gradients
    assert all(torch.equal(p, q) for p, q in zip(sessions["eager_none"].model.parameters(),
                                                 sessions["graphed_static"].model.parameters()))


def test_training_logits_live_in_the_chunk_outputs_scratch_until_the_backward_takes_it():
    """Note [logits in the chunk output's scratch]: a training step's logits are written into
    the last sublayer graph's forward scratch, the memory its chunk output came in, and no eager
    allocation; that backward graph takes the memory back (the tape poisons what a graph gave
    back once another graph of its pool replays), so the memory is lent and not kept. A
    forward's logits, which its caller keeps, are its own storage and survive the next step."""
    from mhc_cg.core.storage import storage_id
    from mhc_cg.lab.resolve import resolve
    from mhc_cg.training.session import TrainSession

    cfg = small_config(["attn", "mlp", "mhc_recompute"])
    session = TrainSession.build(resolve(cfg, "graphed_static", torch.device("cpu")))
    graphed = session.mode_model
    memory = graphed.logits_memory
    assert memory is not None
    seen = []
    graphed.model.head.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    session.step()
    assert len(seen) == cfg.train.num_microbatches
    assert all(storage_id(out) == storage_id(memory) for _, out in seen)
    assert torch.isnan(memory).all()  # given back: the backward graphs replayed over it

    seen.clear()
    inputs, targets = ProgressionCorpus(cfg.model.vocab_size, cfg.model.seq_length,
                                        seed=5).batch(cfg.train.micro_batch_size)
    logits = session.forward(inputs, torch.tensor(7))
    assert storage_id(seen[0][1]) != storage_id(memory)
    kept = logits.detach().clone()
    session.step()  # releases the forward whose backward never came, then trains
    assert torch.equal(logits, kept)
