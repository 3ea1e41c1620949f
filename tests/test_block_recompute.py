"""Block recompute through the model and the manager: bit-identical gradients, order, errors."""

import functools
import pytest
import torch

from mhc_cg.recompute.checkpoint import CheckpointWithoutOutput
from mhc_cg.model.moe import MoECudaGraphPartialCaptureSignal
from mhc_cg.lab.references.eager import EagerModel
from mhc_cg.model import MHCGPT, MHCGPTConfig
from mhc_cg.recompute.block_recompute import BlockRecomputeManager

TINY = dict(vocab_size=32, seq_length=8, hidden_size=16, num_heads=2, num_layers=4, num_streams=4,
            hidden_dropout=0.2)


def _grads(mode_model: EagerModel, ids, seed=None):
    mode_model.model.zero_grad(set_to_none=True)
    mode_model(ids, seed).float().square().mean().backward()
    return {n: p.grad.clone() for n, p in mode_model.model.named_parameters()}


def _pair(**overrides):
    """Eager without recompute and eager block recompute (``eager_none``, ``eager_block``)."""
    torch.manual_seed(0)
    plain = EagerModel(MHCGPT(MHCGPTConfig(**{**TINY, **overrides})).train())
    blocked = EagerModel(MHCGPT(MHCGPTConfig(**{**TINY, **overrides, "recompute": "block"})).train())
    blocked.model.load_state_dict(plain.model.state_dict())
    return plain, blocked


@pytest.mark.parametrize("impl,block_size", [("counter", 1), ("counter", 3), ("counter", None),
                                             ("torch", 2), ("torch", 3)])
def test_block_recompute_gradients_are_bit_identical(impl, block_size):
    plain, blocked = _pair(dropout_impl=impl, recompute_layers=block_size)
    ids = torch.randint(0, 32, (2, 8))
    seed = torch.tensor(4321) if impl == "counter" else None
    torch.manual_seed(7)
    ref = _grads(plain, ids, seed)
    torch.manual_seed(7)  # torch dropout: the same draws; the recompute must replay them
    got = _grads(blocked, ids, seed)
    mismatched = [n for n in ref if not torch.equal(ref[n], got[n])]
    assert not mismatched, mismatched
    assert blocked.model.cfg.hidden_dropout > 0 and len(blocked.recompute_managers) == -(-4 // blocked.model.cfg.resolved_recompute_layers)


def test_forward_frees_every_checkpointed_output_and_recomputes_in_forward_order():
    _, blocked = _pair(recompute_layers=2)
    out = blocked(torch.randint(0, 32, (2, 8)), torch.tensor(5))
    first = blocked.recompute_managers[0]
    names = [c.name for c in first.checkpoints]
    assert names == ["layer0/attention/pre", "layer0/attention/post", "layer0/mlp/pre",
                     "layer0/mlp/post", "layer1/attention/pre", "layer1/attention/post",
                     "layer1/mlp/pre"]  # the block end's post is the hook tensor
    # every output is freed but the pre's pass-through x_on, whose memory is its input's
    assert all(o.untyped_storage().nbytes() == 0 for c in first.checkpoints
               for k, o in enumerate(c.outputs) if k not in c.passthrough)
    assert all(c.passthrough == {2} for c in first.checkpoints if c.name.endswith("/pre"))
    out.sum().backward()
    assert first.trace == names
    assert all(c.state == "consumed" for m in blocked.recompute_managers for c in m.checkpoints)


def test_second_backward_through_a_consumed_block_is_a_clear_error():
    _, blocked = _pair()
    loss = blocked(torch.randint(0, 32, (2, 8)), torch.tensor(5)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already consumed"):
        loss.backward()


def _checkpointed(manager, name, fn, *args, **kw):
    return CheckpointWithoutOutput(manager, name=name).checkpoint(fn, *args, **kw)


def test_dependency_errors_name_both_checkpoints():
    x = torch.randn(4, requires_grad=True)
    manager = BlockRecomputeManager()
    a = _checkpointed(manager, "a", torch.exp, x)
    _checkpointed(manager, "b", torch.sin, a, refill={0: "nowhere.out"})
    with pytest.raises(ValueError, match="'b' depends on 'nowhere.out'.*no checkpoint named 'nowhere'"):
        manager.discard_all_outputs_and_register_unified_recompute(a * 2)

    manager = BlockRecomputeManager()
    a = _checkpointed(manager, "a", torch.exp, x, refill={0: "b"})
    b = _checkpointed(manager, "b", torch.sin, a)
    with pytest.raises(ValueError, match="'a' depends on 'b'.*produced after it"):
        manager.discard_all_outputs_and_register_unified_recompute(b * 2)

    manager = BlockRecomputeManager()
    h = _checkpointed(manager, "pair", lambda t: (t.exp(), t.cos()), x, output_keys=("e", "c"))
    _checkpointed(manager, "use", torch.sin, h[0], refill={0: "pair.z"})
    with pytest.raises(ValueError, match="'pair' has no output 'z'; its outputs are \\['e', 'c'\\]"):
        manager.discard_all_outputs_and_register_unified_recompute(h[1] * 2)


def test_refilled_chain_matches_plain_autograd():
    torch.manual_seed(1)
    x = torch.randn(6, 5, requires_grad=True)
    ref = torch.autograd.grad((x.exp().sin() * x.cos()).square().sum(), x)[0]
    manager = BlockRecomputeManager()
    e = _checkpointed(manager, "exp", torch.exp, x)
    s = _checkpointed(manager, "sin", torch.sin, e, refill={0: "exp"})  # e is not saved
    c = _checkpointed(manager, "cos", torch.cos, x)
    out = s * c
    manager.discard_all_outputs_and_register_unified_recompute(out)
    got = torch.autograd.grad(out.square().sum(), x)[0]
    assert torch.equal(got, ref) and manager.trace == ["exp", "sin", "cos"]


def test_moe_partial_capture_signal_mid_block_leaves_nothing_behind():
    overrides = dict(num_experts=3, moe_top_k=2, recompute_layers=4)
    plain, blocked = _pair(**overrides)
    ids, seed = torch.randint(0, 32, (2, 8)), torch.tensor(9)
    moe = blocked.model.layers[2].mlp.fn
    with pytest.MonkeyPatch.context() as patch:  # raises in the middle of the only block
        patch.setattr(moe, "forward", functools.partial(type(moe).forward, moe,
                                                        partial_capture="route"))
        with pytest.raises(MoECudaGraphPartialCaptureSignal):
            blocked(ids, seed)
    (manager,) = blocked.recompute_managers
    assert manager.is_empty and len(manager) == 0 and manager.state == "idle"
    ref, got = _grads(plain, ids, seed), _grads(blocked, ids, seed)
    mismatched = [n for n in ref if not torch.equal(ref[n], got[n])]
    assert not mismatched, mismatched


def test_exception_after_discard_restores_storage_and_removes_hooks():
    x = torch.randn(4, requires_grad=True)
    manager = BlockRecomputeManager()
    with pytest.raises(KeyError):
        with manager.forward_scope():
            y = _checkpointed(manager, "exp", torch.exp, x)
            out = y * 2
            manager.discard_all_outputs_and_register_unified_recompute(out)
            raise KeyError("unwind")
    assert manager.is_empty
    assert y.untyped_storage().nbytes() == y.numel() * 4  # put back, no hook left on `out`
    with pytest.raises(RuntimeError, match="abandoned"):
        out.sum().backward()  # only if someone keeps the unwound graph: a clear error, not garbage
