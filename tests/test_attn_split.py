"""Mode ``attn_split`` (attention consumer graphed, mHC ops eager under block recompute) through
the ``tape`` backend: bit-identical to eager without recompute, aggregate written in place."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mhc_cg.lab.references.split_attention import StaticInputCheckpoint
from helpers import build_for_mode
from mhc_cg.lab.resolve import resolve

from helpers import assert_training_close, assert_training_identical, small_config


def split_config(num_experts=None):
    return small_config(["attn"], num_experts)


@pytest.mark.parametrize("experts", [None, 4], ids=["dense", "moe"])
def test_five_steps_bit_identical_to_eager_without_recompute(experts):
    cfg = split_config(experts)
    split = assert_training_identical(cfg, "attn_split", 5)
    assert split.info["graphs"] == 2 * cfg.model.num_layers  # one forward + one backward each
    assert split.losses[-1] < split.losses[0]


def test_plan_graphs_attention_only_whatever_the_scopes():
    cfg = small_config(["attn", "mlp", "mhc_recompute"])
    plan = resolve(cfg, "attn_split", "cpu").plan
    assert (plan.attn, plan.mlp, plan.recompute_graph, plan.scopes) == (True, False, False, ("attn",))


def test_fn_input_lives_in_the_static_input_and_the_recompute_rewrites_it():
    """The pre checkpoint's F input is the graph's static input: the replay copies nothing,
    discard keeps the bytes, and the recompute writes the forward's values back before the graph's
    backward reads them (a clobbered slot would change the gradients)."""
    cfg = split_config()
    graphed = build_for_mode(cfg, "attn_split", torch.device("cpu"))
    model, forward = graphed.model, graphed
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length),
                        generator=torch.Generator().manual_seed(0))
    seed = torch.tensor(7)
    ptrs = [s.data_ptr() for s in graphed.slots]
    loss = forward(ids, seed).float().square().mean()
    aggregates = [c for m in graphed.recompute_managers for c in m.checkpoints
                  if isinstance(c, StaticInputCheckpoint)]
    assert len(aggregates) == cfg.model.num_layers
    assert [c.outputs[0].data_ptr() for c in aggregates] == ptrs
    forward_values = [s.detach().clone() for s in graphed.slots]
    assert all(s.untyped_storage().nbytes() > 0 for s in graphed.slots)  # discard kept them
    for slot in graphed.slots:
        slot.detach().fill_(1e3)  # what a later microbatch's forward would leave there
    loss.backward()
    assert [s.data_ptr() for s in graphed.slots] == ptrs
    for got, want in zip(graphed.slots, forward_values):
        assert torch.equal(got.detach(), want)

    # the same step with the slots left alone gives the same gradients
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    forward(ids, seed).float().square().mean().backward()
    for name, g in grads.items():
        assert torch.equal(model.get_parameter(name).grad, g), name


def test_discard_refuses_an_fn_input_that_left_the_slot():
    from mhc_cg.recompute.block_recompute import BlockRecomputeManager

    manager = BlockRecomputeManager()
    slot = torch.zeros(3)
    ckpt = StaticInputCheckpoint(manager, slot, 0, name="pre")
    x = torch.ones(3, requires_grad=True)
    ckpt.checkpoint(lambda t: t * 2, x)  # returns a fresh tensor, not the slot
    with pytest.raises(RuntimeError, match="not the graph's static input"):
        ckpt.discard_outputs()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_five_steps_match_eager_without_recompute_on_cuda():
    """Through ``torch.cuda.CUDAGraph``: kernels may differ inside a capture, so values within a
    tolerance; the static inputs never move and the aggregate stays written into them."""
    cfg = split_config()
    cfg.train = dataclasses.replace(cfg.train, device="cuda")
    cfg.graph = dataclasses.replace(cfg.graph, backend="cuda")
    assert_training_close(cfg, "attn_split", 5)
    graphed = build_for_mode(cfg, "attn_split", torch.device("cuda"))
    forward = graphed
    ptrs = [s.data_ptr() for s in graphed.slots]
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length),
                        device="cuda")
    for _ in range(3):
        forward(ids, torch.tensor(3, device="cuda")).float().square().mean().backward()
    assert [s.data_ptr() for s in graphed.slots] == ptrs
