"""CheckpointWithoutOutput on its own: discard, recompute, gradients, RNG, errors."""

import pytest
import torch

from mhc_cg.recompute.checkpoint import CheckpointWithoutOutput


def _mlp(x, w):
    return torch.nn.functional.dropout(torch.tanh(x @ w), 0.3, training=True)


def test_output_storage_freed_then_restored_and_grads_match_plain_autograd():
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    rng = torch.get_rng_state()
    ref = (_mlp(x, w).sin() * 2).sum()  # sin saves its input: the checkpointed output
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w))

    torch.set_rng_state(rng)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(_mlp, x, w)
    out = y.sin() * 2
    ckpt.discard_output_and_register_recompute(out)
    assert y.untyped_storage().nbytes() == 0  # freed; `sin` holds an empty storage now
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    assert torch.equal(gx, ref_gx) and torch.equal(gw, ref_gw)  # same dropout mask: RNG restored
    assert y.untyped_storage().nbytes() == y.numel() * y.element_size()


def test_recompute_leaves_the_global_rng_where_the_forward_left_it():
    x = torch.randn(4, 4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(_mlp, x, torch.eye(4))
    out = y * 3
    ckpt.discard_output_and_register_recompute(out)
    after_forward = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)


def test_second_backward_is_a_clear_error():
    x = torch.randn(4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(torch.exp, x)
    out = y * y
    ckpt.discard_output_and_register_recompute(out)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already consumed"):
        out.sum().backward()


def test_output_aliasing_an_input_is_rejected():
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="shares storage with tensor input 0"):
        CheckpointWithoutOutput().checkpoint(lambda t: t.view(16), x)


def test_refill_without_manager_and_nondeterministic_fn_are_errors():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="need a BlockRecomputeManager"):
        CheckpointWithoutOutput().checkpoint(torch.exp, x, refill={0: "src"})
    calls = []

    def shape_changes(t):
        calls.append(1)
        return t.repeat(len(calls))

    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(shape_changes, x)
    out = y * 2
    ckpt.discard_output_and_register_recompute(out)
    with pytest.raises(RuntimeError, match="recomputed output 0 has shape"):
        out.sum().backward()


def test_debug_mode_catches_a_value_change():
    x = torch.randn(4, requires_grad=True)
    state = {"bump": 0.0}
    ckpt = CheckpointWithoutOutput(debug=True)
    y = ckpt.checkpoint(lambda t: t * 2 + state["bump"], x)
    out = y * y
    ckpt.discard_output_and_register_recompute(out)
    state["bump"] = 1.0
    with pytest.raises(RuntimeError, match="differs from the forward"):
        out.sum().backward()
