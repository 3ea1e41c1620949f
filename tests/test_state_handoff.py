"""The post computes the next pre's state from the tiles it writes, and the pre reads its input
once: the same bits as the pre computing the state itself, in every kernel and mode."""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhc_cg.model import MHCGPT, MHCGPTConfig, hands_state
from mhc_cg.model.gpt import lm_loss
from mhc_cg.ops import kernels as fused
from mhc_cg.ops.kernels import reference
from mhc_cg.ops.kernels.dispatch import triton_installed

needs_triton = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")


class OpCounter(TorchDispatchMode):
    """Counts the fused ops that run."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.startswith("mhc_cg::"):
            self.ops[func._schema.name.removeprefix("mhc_cg::")] += 1
        return func(*args, **(kwargs or {}))


def _alone(model, ids, seed):
    """The model's logits with every sublayer run alone: no post hands a state on."""
    x = model.embed(ids)
    for sub in model.sublayers():
        x = sub(x, seed)
    return model.logits(x)


def _step(model, ids, seed, kernels, forward=None):
    with OpCounter() as counter:
        logits = model(ids, seed) if forward is None else forward(model, ids, seed)
        lm_loss(logits, ids, kernels).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logits.detach(), grads, counter.ops


def test_model_hands_each_pre_its_state_and_keeps_every_bit():
    """A model whose posts hand on states against the same model whose pres compute their own
    (torch reference, dropout on): the same logits and gradients bit for bit; every pre but the
    first took its state from the post before it."""
    torch.manual_seed(0)
    cfg = MHCGPTConfig(vocab_size=32, seq_length=8, hidden_size=16, num_heads=2, num_layers=2,
                       num_streams=4, hidden_dropout=0.2, kernels="torch")
    handing = MHCGPT(cfg).train()
    own = copy.deepcopy(handing)
    subs = handing.sublayers()
    assert all(hands_state(sub, nxt) for sub, nxt in zip(subs, subs[1:]))
    ids, seed = torch.randint(0, 32, (2, 8)), torch.tensor(5)
    logits, grads, ops = _step(handing, ids, seed, "torch")
    logits_own, grads_own, ops_own = _step(own, ids, seed, "torch", forward=_alone)
    assert torch.equal(logits, logits_own)
    assert grads.keys() == grads_own.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_own[name]), name
    sublayers = 2 * cfg.num_layers
    assert (ops["pre"], ops["pre_from_state"], ops["post_state"], ops["post"]) == \
        (1, sublayers - 1, sublayers - 1, 1)
    assert (ops_own["pre"], ops_own["post"], ops_own["post_state"]) == (sublayers, sublayers, 0)


def test_a_stream_written_after_the_post_gets_a_state_of_its_own():
    """A handoff holds for the post's output only while that tensor is unwritten: a pre given
    the stream after an in-place write computes the state of what it reads."""
    torch.manual_seed(1)
    cfg = MHCGPTConfig(vocab_size=32, seq_length=8, hidden_size=16, num_heads=2, num_layers=1,
                       num_streams=4, hidden_dropout=0.0, kernels="torch")
    model = MHCGPT(cfg)
    attn, mlp = model.layers[0].attention, model.layers[0].mlp
    x = torch.randn(8, 2, 64)
    with torch.no_grad():
        out, handoff = attn.step(x, None, None, mlp)
        pre = (mlp.hc.mapping_proj.weight, mlp.hc.alpha_pre, mlp.hc.bias, True, mlp.norm.eps)
        assert handoff.for_pre(out, *pre)[0] is not None
        assert handoff.for_pre(out.clone(), *pre) == (None, None)  # another tensor
        assert handoff.for_pre(out, attn.hc.mapping_proj.weight, *pre[1:]) == (None, None)
        out.mul_(2.0)
        assert handoff.for_pre(out, *pre) == (None, None)
        fn_input, state, _ = mlp.pre(out, handoff=handoff)
        fn_input_own, state_own, _ = mlp.pre(out.clone())
    assert torch.equal(state, state_own) and torch.equal(fn_input, fn_input_own)


def _post_and_next_state(k, dtype, transposed: bool, p: float):
    """``(post then pre's state, post_state)`` of one kernel module on the same inputs."""
    n, c, t = 4, 40, 21  # two feature chunks of the state pass, the last one and the tokens masked
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, n * c, generator=g).to(dtype)
    y = torch.randn(t, c, generator=g).to(dtype)
    m = n * n + 2 * n
    weight = (torch.randn(m, n * c, generator=g) * 0.2).to(dtype)
    bias, nbias = torch.randn(m, generator=g), torch.randn(m, generator=g)
    a = [torch.tensor([v]) for v in (0.7, -0.4, 1.3)]
    state = k.pre(x, weight, *a, bias, None, n, 4, 1e-5)[1]
    maps = k.post_maps(state[None], bias[None], a[1], a[2], n * c, n, 4)[0]
    seed = torch.tensor(9)
    out = k.post(x, state, *a, bias, y, seed, p, 3, n, 4, h_res_transposed=transposed, maps=maps)
    norm_w = torch.rand(c, generator=g) + 0.5
    next_state = k.pre(out, weight, a[0], a[0], a[0], nbias, norm_w, n, 4, 1e-5)[1]
    fused_out, fused_state = k.post_state(x, maps, y, seed, p, 3, n, weight, a[0], nbias, True,
                                          1e-5, h_res_transposed=transposed)
    return (out, next_state), (fused_out, fused_state)


@pytest.mark.parametrize("transposed,p", [(False, 0.0), (True, 0.3)])
def test_reference_post_state_is_post_then_state(transposed, p):
    (out, state), (fused_out, fused_state) = _post_and_next_state(reference, torch.float32,
                                                                  transposed, p)
    assert torch.equal(out, fused_out) and torch.equal(state, fused_state)


@needs_triton
@pytest.mark.parametrize("dtype,transposed,p", [(torch.float32, False, 0.0),
                                                (torch.bfloat16, True, 0.3)])
def test_triton_post_state_is_post_then_state_bit_for_bit(dtype, transposed, p):
    """One kernel writes the stream and its state (interpreter): the stream's bits are the post
    kernel's, the state's the pre's state pass on that stream."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1)")
    k = fused.dispatch.triton_kernels()
    (out, state), (fused_out, fused_state) = _post_and_next_state(k, dtype, transposed, p)
    assert torch.equal(out, fused_out)
    assert torch.equal(state, fused_state)
