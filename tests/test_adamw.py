"""The training's AdamW: torch's AdamW to the bit, with the step's temporary one slice."""

from __future__ import annotations

import copy

import pytest
import torch

from mhc_cg.tools.cost.op_counters import StepRecorder
from mhc_cg.training.adamw import SlicedAdamW


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 11), (5,), (64, 3), (1,)]  # sizes that slices of 7 bf16 (3 fp32) elements cut unevenly
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _run(opt_cls, params, steps, **kwargs):
    opt = opt_cls(params, lr=3e-3, weight_decay=0.1, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slice_bytes", [14, 256, 64 << 20])
def test_sliced_adamw_is_torch_adamw_bit_for_bit(dtype, slice_bytes):
    ours, theirs = _params(dtype), _params(dtype)
    opt = _run(SlicedAdamW, ours, 3, slice_bytes=slice_bytes)
    ref = _run(torch.optim.AdamW, theirs, 3, foreach=False)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], ref.state[b][key]), key
    # the state is torch's: a checkpoint of one loads into the other and goes on identically
    again = _params(dtype, seed=5)
    moved = [p.detach().clone().requires_grad_() for p in again]
    torch_opt = torch.optim.AdamW(moved, lr=3e-3, weight_decay=0.1, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    ours_opt = SlicedAdamW(again, lr=3e-3, weight_decay=0.1, slice_bytes=slice_bytes)
    ours_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # no shared tensors
    for p, q in zip(again, moved):
        p.grad = q.grad = torch.ones_like(p)
    ours_opt.step(), torch_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(again, moved))


def test_the_step_allocates_one_slice_not_the_parameter():
    """The cost model's allocator view (LiveBytes, 512-byte blocks) of one step: the most alive at
    once is one 1 KiB slice; torch's two parameter-sized temporaries for the same parameter."""
    p = torch.nn.Parameter(torch.randn(1000, 10))
    p.grad = torch.randn_like(p)
    opt = SlicedAdamW([p], slice_bytes=1024)
    opt.step()  # the first step makes the moments (parameter-sized, kept)
    with StepRecorder() as ours:
        opt.step()
    assert ours.live.peak == 1024
    theirs = torch.optim.AdamW([p], foreach=False)
    theirs.step()
    with StepRecorder() as torch_step:
        theirs.step()
    assert torch_step.live.peak >= 2 * p.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lent_workspace_takes_the_scratch_and_changes_no_bit(dtype):
    """With a workspace lent (a graphed mode's idle arena) the step allocates nothing, its slices
    span the workspace, and the update is still torch's to the bit; a workspace smaller than one
    slice is left alone and the step allocates its slice."""
    lent = torch.full((301,), 255, dtype=torch.uint8)  # odd bytes: fp32 slices of 75 elements
    ours, theirs = _params(dtype), _params(dtype)
    opt = SlicedAdamW(ours, lr=3e-3, weight_decay=0.1, slice_bytes=14, workspace=lambda: lent)
    ref = torch.optim.AdamW(theirs, lr=3e-3, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        for p, q in zip(ours, theirs):
            p.grad = q.grad = torch.randn(p.shape, generator=g).to(dtype)
        with StepRecorder() as recorded:
            opt.step()
        ref.step()
    assert recorded.live.peak == 0  # the second step: the moments exist, the scratch is lent
    assert (lent != 255).any()  # the denominators went there
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    too_small = torch.empty(1000, dtype=torch.uint8)
    small = SlicedAdamW([torch.nn.Parameter(torch.randn(1000))], slice_bytes=1024,
                        workspace=lambda: too_small)
    small.param_groups[0]["params"][0].grad = torch.randn(1000)
    small.step()
    with StepRecorder() as recorded:
        small.step()
    assert recorded.live.peak == 1024


def test_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="slice_bytes"):
        SlicedAdamW([torch.nn.Parameter(torch.ones(2))], slice_bytes=0)
    p = torch.nn.Parameter(torch.ones(4, 4))
    p.grad = torch.ones(4, 4).t()  # a transposed gradient cannot be sliced in place of p's
    with pytest.raises(RuntimeError, match="contiguous"):
        SlicedAdamW([p]).step()
