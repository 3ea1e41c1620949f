"""Fused mHC ops: the torch reference against the composed torch math (values and gradients),
Triton (the interpreter on CPU) against the reference, the block recompute reproducing the forward
bit for bit, dropout masks bit-exact, one op per step under the graph tape, and the
kernel-launch count of a training step."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhc_cg.lab.benchmarks.timing import time_repeated
from mhc_cg.config import RunConfig, check
from mhc_cg.config.rules import device_fit_problems
from mhc_cg.core.errors import ConfigError
from mhc_cg.model import MHCGPTConfig
from mhc_cg.ops import kernels as fused
from mhc_cg.ops.dropout import counter_dropout_mask
from mhc_cg.ops.hyper_connection import HyperConnection, sinkhorn_knopp
from mhc_cg.ops.kernels import reference
from mhc_cg.ops.kernels.dispatch import triton_installed
from mhc_cg.lab.compare.modes import compared_modes
from kernel_count import KernelCounter, kernels_per_layer

ROOT = Path(__file__).resolve().parents[1]
S, B = 3, 2
EPS = 1e-5
needs_triton = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")


@pytest.fixture
def interpret():
    """Triton's interpreter on CPU: tests/conftest.py sets TRITON_INTERPRET=1 before triton loads."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the Triton kernels are compared on CUDA tensors (cuda-marked tests)")
    if os.environ.get("TRITON_INTERPRET") != "1" or not fused.dispatch.triton_kernels().INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")


def make_hc(n: int, c: int, dtype=torch.float32, seed=0, iterations=20,
            **options) -> HyperConnection:
    torch.manual_seed(seed)
    hc = HyperConnection(c, num_streams=n, sinkhorn_iterations=iterations,
                         init_gating_factor=0.3, **options).to(dtype)
    with torch.no_grad():
        hc.mapping_proj.weight.normal_(std=0.5)
        hc.bias.normal_()
        hc.alpha_pre.fill_(0.7)
        hc.alpha_post.fill_(-0.4)
        hc.alpha_res.fill_(1.3)
    return hc


def fn(z: torch.Tensor) -> torch.Tensor:
    """A stand-in sublayer F whose gradient depends on its input."""
    return torch.tanh(z) * 1.5


def composed_sublayer(hc, x, norm_weight, seed, p, stream):
    """One sublayer in composed torch ops: mappings, aggregate, RMSNorm, F, H_res, H_post, dropout."""
    h_pre, h_post, h_res = hc.compute_mappings(x)
    agg = hc.aggregate(x, h_pre)
    if norm_weight is not None:
        agg = agg * torch.rsqrt(agg.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight
    return hc.post_bda(fn(agg), h_post, hc.apply_h_res(h_res, x), seed, p, stream)


def fused_sublayer(hc, x, norm_weight, seed, p, stream):
    fn_input, state, x_on = hc.pre(x, norm_weight, EPS)
    return hc.post(x_on, state, fn(fn_input), seed, p, stream)


# ---- the torch reference against the composed torch math ---------------------------------------

@pytest.mark.parametrize("n,norm,p", [(1, True, 0.0), (3, True, 0.3), (4, False, 0.2), (4, True, 0.0)])
def test_fused_sublayer_matches_composed_math_and_its_gradients(n, norm, p):
    c = 5
    hc = make_hc(n, c, torch.float64)
    hc.kernels = "torch"
    x = torch.randn(S, B, n * c, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(c, dtype=torch.float64) + 0.5).requires_grad_() if norm else None
    seed = torch.tensor(11)
    assert_fused_equals_composed(hc, x, w, seed, p)


def assert_fused_equals_composed(hc, x, w, seed, p):
    """The fused sublayer against the composed one (fp64): output and every gradient; returns
    the composed output."""
    want = composed_sublayer(hc, x, w, seed, p, 3)
    got = fused_sublayer(hc, x, w, seed, p, 3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    params = [x, *hc.parameters(), *([w] if w is not None else [])]
    for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    return want


def test_reference_ops_pass_gradcheck():
    """The pre and the post together (the post's backward hands x's residual gradient to the
    pre's), every output (the sublayer's, F's input and the whole state) against finite
    differences of every input and parameter."""
    n, c = 3, 4
    hc = make_hc(n, c, torch.float64, iterations=6)
    x = torch.randn(2, 1, n * c, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 1, c, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(c, dtype=torch.float64) + 0.5).requires_grad_()
    weight, bias, alphas = hc.mapping_proj.weight, hc.bias, [hc.alpha_pre, hc.alpha_post, hc.alpha_res]

    def sublayer(x, y, weight, bias, a_pre, a_post, a_res, w):
        fn_input, state, x_on = fused.pre(x, weight, a_pre, a_post, a_res, bias, w, n, 6, EPS,
                                          "torch")
        out = fused.post(x_on, state, a_pre, a_post, a_res, bias, y * fn_input.sum(),
                         torch.tensor(5), 0.3, 2, n, 6, "torch")
        return out, fn_input, state

    assert torch.autograd.gradcheck(sublayer, (x, y, weight, bias, *alphas, w))
    assert torch.autograd.gradcheck(lambda a, b: fused.rms_norm(a, b, EPS), (y, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_loss_is_cross_entropy_in_fp32_chunk_by_chunk(monkeypatch, dtype):
    """``lm_loss`` against ``F.cross_entropy`` on the upcast logits, value and gradient, with
    chunks of 3 rows (a last one short): what the model trained with before, without its fp32
    copy of the logits."""
    from mhc_cg.model import lm_loss

    monkeypatch.setattr(reference, "CE_CHUNK_BYTES", 3 * 4 * 50)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, 50, generator=g, dtype=torch.float64) * 5).to(dtype)
    targets = torch.randint(0, 50, (2, 5), generator=g)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = lm_loss(ours, targets, "torch")
    want = torch.nn.functional.cross_entropy(theirs.flatten(0, 1).to(acc), targets.flatten())
    loss.backward()
    want.backward()
    assert loss.dtype == acc and ours.grad.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(loss, want, rtol=tol, atol=tol)
    # bf16: both round the same fp32 gradient once; the exp's last bit may differ
    torch.testing.assert_close(ours.grad.to(acc), theirs.grad.to(acc), rtol=tol,
                               atol=4e-3 if dtype == torch.bfloat16 else tol)


def test_post_given_x_instead_of_x_on_is_refused():
    hc = make_hc(2, 4)
    x = torch.randn(S, B, 8, requires_grad=True)
    fn_input, state, _ = hc.pre(x, None, EPS)
    with pytest.raises(ValueError, match="x_on that pre returned"):
        hc.post(x, state, fn(fn_input), None, 0.0, 0)


def test_post_mask_is_mhc_cg_dropout_mask():
    """With H_post = 1 (zero logits) and x = 0 the post's output is the dropout mask itself."""
    n, c, p, t = 4, 7, 0.3, S * B
    seed = torch.tensor(2024)
    zeros = torch.zeros(1)
    state = torch.zeros(t, reference.state_width(n * n + 2 * n))
    bias = torch.zeros(n * n + 2 * n)
    out = reference.post(torch.zeros(t, n * c), state, zeros, zeros, zeros, bias,
                         torch.ones(t, c), seed, p, 9, n, 4)
    assert torch.equal(out, counter_dropout_mask(seed, 9, out.shape, p, torch.float32))
    assert not torch.equal(out, counter_dropout_mask(seed, 8, out.shape, p, torch.float32))


def test_counter_hash_is_murmur3_fmix_in_32_bits():
    """The int32 hash equals the same hash in exact Python integers mod 2**32."""
    from mhc_cg.ops.kernels.hash import counter_hash

    mask = 0xFFFFFFFF

    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & mask
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & mask
        return h ^ (h >> 16)

    idx = torch.arange(70001, dtype=torch.int32)
    for seed, stream in [(0, 0), (12345, 3), (2 ** 31 - 1, 77)]:
        key = fmix((seed * 0x9E3779B9 + stream) & mask)
        want = torch.tensor([fmix(i ^ key) for i in range(idx.numel())], dtype=torch.int64)
        got = counter_hash(torch.tensor(seed, dtype=torch.int32), stream, idx).to(torch.int64) & mask
        assert torch.equal(got, want)


# ---- Triton (interpreter) against the torch reference ------------------------------------------

def op_cases(device, dtype, n: int, c: int, t: int, norm: bool = True, p: float = 0.2,
             h_res_transposed: bool = False, arithmetic: str = "main") -> dict:
    """Every op, forward and backward, on the same random inputs; ``case(use_triton)`` runs one.
    ``arithmetic``: main's, or dev's (given only then: the default calls omit it)."""
    from mhc_cg.ops.kernels import custom_ops as ops

    g = torch.Generator().manual_seed(0)

    def rand(*shape, lo=None):
        r = torch.randn(*shape, generator=g) if lo is None else torch.rand(*shape, generator=g) + lo
        return r.to(device=device, dtype=dtype)

    m = n * n + 2 * n
    x, y, w = rand(t, n * c), rand(t, c), rand(m, n * c) * 0.3
    bias, nw = rand(m), rand(c, lo=0.5) if norm else None
    alphas = [torch.full((1,), v, device=device, dtype=dtype) for v in (0.7, -0.4, 1.3)]
    seed = torch.tensor(3, device=device)
    ar = {"arithmetic": arithmetic} if arithmetic != "main" else {}
    state = reference.pre(x, w, *alphas, bias, nw, n, 20, EPS, **ar)[1]  # the downstream ops'
    prev_state = reference.pre(y.repeat(1, n), w, *alphas, bias, nw, n, 20, EPS, **ar)[1]
    g_state = torch.randn(t, m + 2, generator=g).to(device)
    g_out, g_x, g_post = rand(t, c), rand(t, n * c), rand(t, n * c)
    logits = rand(t, n * c + 7) * 4  # a vocabulary that no block size divides
    targets = torch.randint(0, n * c + 7, (t,), generator=g).to(device)
    lse = reference.cross_entropy(logits, targets)[1]
    g_loss = torch.rand(t, generator=g).to(device=device, dtype=lse.dtype)
    ht = (True,) if h_res_transposed else ()  # the default layout: calls without the argument
    return {
        "pre": lambda tri: ops.pre(x, w, *alphas, bias, nw, n, 20, EPS, tri, **ar),
        "pre_backward": lambda tri: ops.pre_backward(g_out, g_state, g_x, x, w, *alphas, bias, nw,
                                                     state, n, 20, EPS, tri, *ht, **ar),
        "pre_backward_into": lambda tri: (*ops.pre_backward_into(
            g_out, g_state, g_post := g_x.clone(), x, w, *alphas, bias, nw, state, n, 20, EPS, tri,
            *ht, **ar), g_post),
        "post_maps": lambda tri: ops.post_maps(state[None], bias[None], alphas[1], alphas[2],
                                               n * c, n, 20, tri, **ar),
        "post": lambda tri: ops.post(x, state, ops.post_maps(state[None], bias[None], alphas[1],
                                                             alphas[2], n * c, n, 20, tri,
                                                             **ar)[0],
                                     *alphas, bias, y, seed, p, 3, n, 20, tri, *ht),
        "post_backward": lambda tri: ops.post_backward(g_post, x, state, *alphas, bias, y, seed, p,
                                                       3, n, 20, tri, *ht, **ar),
        # the pre's backward with its post's reductions and the previous post's g_y
        "pre_backward_fused": lambda tri: (*ops.pre_backward_into(
            g_out, g_state, g_post := g_x.clone(), x, w, *alphas, bias, nw, state, n, 20, EPS, tri,
            h_res_transposed, y, seed, p, 3, prev_state, alphas[1] * 0.5, bias.flip(0), 5,
            g_y := torch.empty_like(y), **ar), g_post, g_y),
        "post_grad_y": lambda tri: ops.post_grad_y(g_post, state, alphas[1], bias, seed, p, 3, n,
                                                   dtype, tri),
        "rms_norm": lambda tri: ops.rms_norm(y, w[0, :c].abs() + 0.5, EPS, tri),
        "rms_norm_backward": lambda tri: ops.rms_norm_backward(g_out, y, w[0, :c].abs() + 0.5, EPS,
                                                               tri),
        "cross_entropy": lambda tri: ops.cross_entropy(logits, targets, tri),
        "cross_entropy_backward": lambda tri: ops.cross_entropy_backward(g_loss, logits, targets,
                                                                         lse, tri),
        "cross_entropy_backward_": lambda tri: (ops.cross_entropy_backward_(
            g_loss, over := logits.clone(), targets, lse, tri), over)[1],
    }


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def assert_ops_match(dtype, n, c, t, norm, rtol, atol, h_res_transposed=False, only=None,
                     arithmetic="main"):
    cases = op_cases("cpu", dtype, n, c, t, norm, h_res_transposed=h_res_transposed,
                     arithmetic=arithmetic)
    for name, run in cases.items():
        if only is not None and name not in only:
            continue
        for k, (got, want) in enumerate(zip(_as_tuple(run(True)), _as_tuple(run(False)))):
            assert got.dtype == want.dtype and got.shape == want.shape, (name, k)
            torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{name} output {k}: {m}")


@needs_triton
@pytest.mark.parametrize("n,c,t,norm", [(1, 6, 3, True), (2, 40, 17, True), (3, 10, 5, False),
                                        (4, 24, 6, True), (8, 5, 4, False)])
def test_triton_matches_reference_fp32(interpret, n, c, t, norm):
    """Odd token counts and widths: tiles cross tokens, features and padded streams."""
    assert_ops_match(torch.float32, n, c, t, norm, rtol=1e-5, atol=1e-5)


@needs_triton
def test_pre_backward_over_several_weight_gradient_groups_matches_reference(interpret):
    """300 tokens: two groups of the mapping weight's gradient partials, the last one partly
    filled (``weight_grad_groups``); only the pre's backward groups tokens so."""
    from mhc_cg.ops.kernels.tiling import weight_grad_groups

    assert weight_grad_groups(300, 16, 2 * 2 + 2 * 2, 2)[0] == 2
    assert_ops_match(torch.float32, 2, 16, 300, True, rtol=1e-5, atol=1e-5,
                     only=("pre_backward", "pre_backward_into"))


@needs_triton
@pytest.mark.parametrize("n,c,norm", [(3, 10, True), (4, 24, False)])
def test_triton_matches_reference_bf16(interpret, n, c, norm):
    """Both compute in fp32 from the same bf16 inputs and round once to bf16."""
    assert_ops_match(torch.bfloat16, n, c, 6, norm, rtol=2e-2, atol=2e-2)


def block_chain(impl, x0, ws, params, norms, seed, p, n, iterations, h_res_transposed=False,
                arithmetic="main"):
    """A block's forward through ``impl``'s pre and post, sublayer by sublayer: the sublayer
    inputs after the first, F's inputs, F's outputs and states (F is ``fn``)."""
    xs, fn_inputs, ys, states = [], [], [], []
    x, m = x0, n * n + 2 * n
    for k, (w, prm) in enumerate(zip(ws, params)):
        bias, a = prm[:m], [prm[m + j:m + j + 1] for j in range(3)]
        f_in, state = impl.pre(x, w, *a, bias, None if norms is None else norms[k], n, iterations,
                               EPS, arithmetic=arithmetic)
        y = fn(f_in)
        fn_inputs.append(f_in), ys.append(y), states.append(state)
        if k + 1 < len(ws):
            x = impl.post(x, state, *a, bias, y, seed, p, 10 + 2 * k, n, iterations,
                          **({"h_res_transposed": True} if h_res_transposed else {}),
                          arithmetic=arithmetic)
            xs.append(x)
    return xs, fn_inputs, ys, states


# (streams, hidden, tokens, sublayers, dropout) of the block-recompute cases
BLOCK_SHAPE = (3, 20, 7, 4, 0.25)


def _block_case(seed: int, dtype: torch.dtype = torch.float32, norm: bool = True,
                logit_scale: float = 1.0):
    """A block's inputs: ``(x0, each sublayer's projection, mapping parameters, norms)``."""
    n, c, t, sublayers, _ = BLOCK_SHAPE
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    x0 = torch.randn(t, n * c, generator=g).to(dtype)
    ws = [(torch.randn(m, n * c, generator=g) * 0.3).to(dtype) for _ in range(sublayers)]
    params = torch.cat([torch.randn(sublayers, m, generator=g) * logit_scale,
                        torch.tensor([[0.7, -0.4, 1.3]]).expand(sublayers, 3)], 1).to(dtype)
    norms = (torch.rand(sublayers, c, generator=g) + 0.5).to(dtype) if norm else None
    return x0, ws, params, norms


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("dtype,norm", [(torch.float32, True), (torch.bfloat16, False)])
def test_block_recompute_reproduces_the_forward_bit_for_bit(request, use_triton, dtype, norm):
    """The recompute op rebuilds every sublayer input and F input of a block, from the block
    input, F's outputs and the states, exactly as the pre and post computed them."""
    if use_triton:
        request.getfixturevalue("interpret")
    impl = fused.dispatch.triton_kernels() if use_triton else reference
    n, c, t, sublayers, p = BLOCK_SHAPE
    x0, ws, params, norms = _block_case(2, dtype, norm)
    seed = torch.tensor(99)
    xs, fn_inputs, ys, states = block_chain(impl, x0, ws, params, norms, seed, p, n, 5)
    x_out = torch.full((sublayers - 1, t, n * c), float("nan"), dtype=dtype)
    fn_out = torch.full((sublayers, t, c), float("nan"), dtype=dtype)
    impl.recompute(x0, torch.stack(ys), torch.stack(states), params, norms, seed, p,
                   [10 + 2 * k for k in range(sublayers)], n, 5, EPS, x_out, fn_out)
    assert torch.equal(x_out, torch.stack(xs))
    assert torch.equal(fn_out, torch.stack(fn_inputs))


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_pre_backward_over_the_post_gradient_equals_the_fresh_one(request, use_triton):
    """Writing x's gradient over the post's (the one-buffer chain) changes no bit of it."""
    from mhc_cg.ops.kernels import custom_ops as ops

    if use_triton:
        request.getfixturevalue("interpret")
    case = op_cases("cpu", torch.float32, 4, 24, 9)
    fresh, into = case["pre_backward"](use_triton), case["pre_backward_into"](use_triton)
    assert torch.equal(fresh[0], into[-1])
    for a, b in zip(fresh[1:], into[:-1]):
        assert torch.equal(a, b)


@needs_triton
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_dropout_mask_bit_exact(interpret, p):
    """The post's mask, forward and backward, is ``mhc_cg.ops.dropout``'s for the same seed."""
    impl = fused.dispatch.triton_kernels()
    n, c, t = 3, 37, 8  # odd widths: masks cross feature blocks and streams
    m = n * n + 2 * n
    zeros, bias = torch.zeros(1), torch.zeros(m)
    state = torch.zeros(t, m + 2)
    for seed, stream in [(0, 0), (123456789, 3), (2 ** 31 - 2, 41)]:
        seed_t = torch.tensor(seed)
        out = impl.post(torch.zeros(t, n * c), state, zeros, zeros, zeros, bias, torch.ones(t, c),
                        seed_t, p, stream, n, 4)
        assert torch.equal(out, counter_dropout_mask(seed_t, stream, out.shape, p, torch.float32))
        # d out / d y is the sum over the streams of the kept scale
        g_y = impl.post_backward(torch.ones(t, n * c), torch.zeros(t, n * c), state, zeros, zeros,
                                 zeros, bias, torch.ones(t, c), seed_t, p, stream, n, 4)[2]
        assert torch.equal(g_y, out.view(t, n, c).sum(1))


def test_sinkhorn_backward_where_exp_underflows_is_finite_and_matches_fp64():
    """A column 90 below every row's maximum: exp gives fp32 subnormals there, where the
    gradient with respect to m (as 1/m) overflows fp32."""
    g = torch.Generator().manual_seed(0)
    logits, grad = torch.randn(64, 4, 4, generator=g), torch.randn(64, 4, 4, generator=g)
    logits[:, :, -1] -= 90.0
    leaf = logits.double().requires_grad_()
    (want,) = torch.autograd.grad(sinkhorn_knopp(leaf, 20), leaf, grad.double())
    got = reference.sinkhorn_backward(logits, grad, 20)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@needs_triton
def test_triton_post_backward_where_exp_underflows_matches_the_reference(interpret):
    """Logits that spread past exp's range (a C=4096 model's, say) keep the mappings' gradient
    finite, as the reference's."""
    impl = fused.dispatch.triton_kernels()
    n, c, t = 4, 24, 8
    m = n * n + 2 * n
    g = torch.Generator().manual_seed(1)
    x, y, gg = torch.randn(t, n * c, generator=g), torch.randn(t, c, generator=g), \
        torch.randn(t, n * c, generator=g)
    w = torch.randn(m, n * c, generator=g) * 0.3
    bias = torch.randn(m, generator=g)
    bias[2 * n + n - 1::n] -= 90.0  # the res logits' last column
    alphas = [torch.full((1,), v) for v in (0.7, -0.4, 1.3)]
    state = reference.pre(x, w, *alphas, bias, None, n, 20, EPS)[1]
    args = (gg, x, state, *alphas, bias, y, None, 0.0, 0, n, 20)
    for got, want in zip(impl.post_backward(*args), reference.post_backward(*args)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_triton
def test_sinkhorn_backward_runs_at_most_twice_the_forwards_iterations(interpret, monkeypatch):
    """Note [Sinkhorn's iterates kept]: counted through the interpreter, one program's Sinkhorn
    backward runs 2 x T iterations for the forward's T (rebuilding each iterate from the start
    would run T (T + 1) / 2), and its gradient is still the reference's."""
    impl = fused.dispatch.triton_kernels()
    calls = {"_sk_iteration": 0, "_sk_parts": 0}
    for name in calls:
        original = getattr(impl, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(impl, name, counted)
    n, c, t, iterations = 4, 16, 4, 20  # one program of 4 tokens (CHAIN_ROWS)
    m = n * n + 2 * n
    g = torch.Generator().manual_seed(3)
    x, y, gg = (torch.randn(t, n * c, generator=g), torch.randn(t, c, generator=g),
                torch.randn(t, n * c, generator=g))
    bias = torch.randn(m, generator=g)
    alphas = [torch.full((1,), v) for v in (0.7, -0.4, 1.3)]
    state = reference.pre(x, torch.randn(m, n * c, generator=g) * 0.3, *alphas, bias, None, n,
                          iterations, EPS)[1]
    impl.post_maps(state[None], bias[None], alphas[1], alphas[2], n * c, n, iterations)
    forward = calls["_sk_iteration"]
    assert forward == iterations
    calls.update(_sk_iteration=0, _sk_parts=0)
    args = (gg, x, state, *alphas, bias, y, None, 0.0, 0, n, iterations)
    got = impl.post_backward(*args)
    backward = calls["_sk_iteration"] + calls["_sk_parts"]
    assert backward == 2 * iterations <= 2 * forward
    for mine, want in zip(got, reference.post_backward(*args)):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-5)


@needs_triton
def test_triton_recompute_refuses_outputs_past_int32_indexing():
    """The recompute's output offsets (sublayer x token x feature) are int32: a larger output
    would wrap into other rows, so it is refused before any launch."""
    impl = fused.dispatch.triton_kernels()
    n, c, t, s = 2, 2 ** 14, 2 ** 13, 9  # x_out: 8 x 2^13 x 2^15 = 2^31 elements
    m = n * n + 2 * n
    x_out = torch.empty(s - 1, t, n * c, device="meta")
    with pytest.raises(ValueError, match="int32"):
        impl.recompute(torch.zeros(1, n * c), torch.zeros(s, 1, c), torch.zeros(s, 1, m + 2),
                       torch.zeros(s, m + 3), None, None, 0.0, list(range(s)), n, 5, EPS, x_out,
                       torch.empty(s, t, c, device="meta"))


@needs_triton
def test_triton_refuses_fp64_with_the_fix():
    impl = fused.dispatch.triton_kernels()
    x = torch.zeros(2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="model.kernels: torch"):
        impl.post(x, torch.zeros(2, 10, dtype=torch.float64), *[torch.zeros(1)] * 3,
                  torch.zeros(8), torch.zeros(2, 4, dtype=torch.float64), None, 0.0, 0, 2, 3)


def test_triton_on_cpu_without_interpreter_is_a_config_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: model.kernels: triton is valid here")
    cfg = RunConfig(model=MHCGPTConfig(kernels="triton"))  # a section alone cannot know the device
    with pytest.raises(ConfigError, match="model.kernels: 'triton' on CPU runs only in Triton's interpreter"):
        check(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="cpu")))
    # where the device is resolved (the run's plan), auto on this CPU machine is refused too
    assert any("Triton's interpreter" in p for p in device_fit_problems(cfg, None, "cpu"))
    with pytest.raises(ConfigError, match="model.kernels: must be one of"):
        MHCGPTConfig(kernels="cuda")
    hc = make_hc(2, 4)
    hc.kernels = "triton"
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        hc.pre(torch.randn(1, 1, 8), None, EPS)


def test_cli_rejects_triton_on_cpu_with_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: model.kernels: triton is valid here")
    cfg = tmp_path / "k.yaml"
    cfg.write_text("model: {kernels: triton}\ntrain: {device: cpu}\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "mhc_cg.cli", "config", "check", str(cfg)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "model.kernels: 'triton' on CPU runs only in Triton's interpreter" in proc.stderr


# ---- H_res's transposed layout (Megatron-LM dev): H_res^T x -------------------------------------

def h_res_asymmetry(hc: HyperConnection, x: torch.Tensor) -> float:
    """``max |H_res - H_res^T|`` over the tokens: where it is 0 the layouts agree (every doubly
    stochastic 2 x 2 matrix is symmetric, hence n >= 3 below)."""
    with torch.no_grad():
        h_res = hc.compute_mappings(x)[2]
    return (h_res - h_res.transpose(-1, -2)).abs().max().item()


@pytest.mark.parametrize("n,norm,p", [(3, True, 0.3), (4, False, 0.0)])
def test_transposed_h_res_fused_sublayer_matches_composed_math_and_its_gradients(n, norm, p):
    """The reference pre and post with ``h_res_transposed`` against the non-fused HyperConnection
    with it (fp64, as tight as the default layout's test); the two layouts' outputs differ."""
    c = 5
    main = make_hc(n, c, torch.float64)
    hc = make_hc(n, c, torch.float64, h_res_transposed=True)
    main.kernels = hc.kernels = "torch"
    with torch.no_grad():  # res logits far apart: H_res far from symmetric
        for module in (main, hc):
            module.bias[2 * n:] *= 3.0
    x = torch.randn(S, B, n * c, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(c, dtype=torch.float64) + 0.5).requires_grad_() if norm else None
    seed = torch.tensor(11)
    assert h_res_asymmetry(hc, x) > 0.05
    want = assert_fused_equals_composed(hc, x, w, seed, p)
    assert (want - composed_sublayer(main, x, w, seed, p, 3)).abs().max() > 0.05


def test_post_with_another_h_res_layout_than_its_pre_is_refused():
    """The pre's backward applies H_res to the post's gradient: one layout for both."""
    hc = make_hc(3, 4)
    x = torch.randn(S, B, 12, requires_grad=True)
    fn_input, state, x_on = hc.pre(x, None, EPS)
    hc.h_res_transposed = True
    with pytest.raises(ValueError, match="h_res_transposed must be the pre's"):
        hc.post(x_on, state, fn(fn_input), None, 0.0, 0)


@needs_triton
def test_transposed_h_res_triton_sublayer_matches_composed_math_and_its_gradients(interpret):
    """The Triton pre and post (interpreter, fp32) with ``h_res_transposed`` against the non-fused
    HyperConnection with it, in fp64 from the same values: values and every gradient; the post
    into a buffer (``post_into``) gives the same bits."""
    n, c = 3, 8
    hc = make_hc(n, c, iterations=6, h_res_transposed=True)
    hc.kernels = "triton"
    ref = copy.deepcopy(hc).double()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(S, B, n * c, generator=g, requires_grad=True)
    w = (torch.rand(c, generator=g) + 0.5).requires_grad_()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    seed = torch.tensor(7)
    assert h_res_asymmetry(ref, x64) > 0.05
    got = fused_sublayer(hc, x, w, seed, 0.2, 1)
    want = composed_sublayer(ref, x64, w64, seed, 0.2, 1)
    with torch.no_grad():
        fn_input, state, x_on = hc.pre(x, w, EPS)
        into = hc.post(x_on, state, fn(fn_input), seed, 0.2, 1,
                       out=fused.Target.of(torch.empty_like(got)))
    assert torch.equal(into, got)
    # fp32 against fp64: a few fp32 roundings through 6 Sinkhorn iterations and the norm
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(want.shape, generator=g)
    got_g = torch.autograd.grad(got, [x, *hc.parameters(), w], grad)
    want_g = torch.autograd.grad(want, [x64, *ref.parameters(), w64], grad.double())
    for name, a, b in zip(["x", *dict(hc.named_parameters()), "norm"], got_g, want_g):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


@needs_triton
def test_transposed_h_res_triton_ops_match_reference(interpret):
    """Every op that applies H_res, Triton against the reference, in the transposed layout
    (which changes each of them: neither layout's results are the other's)."""
    # the output H_res changes: x's gradient, the stream, the state's gradient
    layout_ops = {"pre_backward": 0, "pre_backward_into": -1, "post": 0, "post_backward": 0}
    assert_ops_match(torch.float32, 3, 10, 5, True, 1e-5, 1e-5, h_res_transposed=True,
                     only=layout_ops)
    main, dev = (op_cases("cpu", torch.float32, 3, 10, 5, h_res_transposed=ht) for ht in (0, 1))
    for name, k in layout_ops.items():
        a, b = _as_tuple(main[name](False))[k], _as_tuple(dev[name](False))[k]
        assert (a - b).abs().max() > 1e-2, name


# variant: (what the forward and its recompute run, another variant whose recompute must miss
# the forward, by more than, the block's seed)
RECOMPUTE_VARIANTS = {
    "transposed": ({"h_res_transposed": True}, {}, 1e-2, 3),
    "dev": ({"h_res_transposed": True, "arithmetic": "dev"}, {"h_res_transposed": True}, 1e-6, 5)}


@pytest.mark.parametrize("variant", sorted(RECOMPUTE_VARIANTS))
@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_a_variants_block_recompute_reproduces_its_forward_bit_for_bit(request, use_triton,
                                                                       variant):
    """With H_res transposed, and in dev's arithmetic, the recompute rebuilds the block's inputs
    as that variant's pre and post computed them, bit for bit; another variant's recompute
    does not."""
    if use_triton:
        request.getfixturevalue("interpret")
    ours, other, gap, case = RECOMPUTE_VARIANTS[variant]
    impl = fused.dispatch.triton_kernels() if use_triton else reference
    n, c, t, sublayers, p = BLOCK_SHAPE
    x0, ws, params, norms = _block_case(case, logit_scale=2.0)
    seed, streams = torch.tensor(99), [10 + 2 * k for k in range(sublayers)]
    xs, fn_inputs, ys, states = block_chain(impl, x0, ws, params, norms, seed, p, n, 5, **ours)

    def recompute(options):
        x_out = torch.full((sublayers - 1, t, n * c), float("nan"))
        fn_out = torch.full((sublayers, t, c), float("nan"))
        impl.recompute(x0, torch.stack(ys), torch.stack(states), params, norms, seed, p, streams,
                       n, 5, EPS, x_out, fn_out, **options)
        return x_out, fn_out

    x_out, fn_out = recompute(ours)
    assert torch.equal(x_out, torch.stack(xs))
    assert torch.equal(fn_out, torch.stack(fn_inputs))
    x_other, _ = recompute(other)
    assert (x_other - x_out).abs().max() > gap


# ---- one op per step: what the graph tape records ----------------------------------------------

def test_tape_records_each_fused_op_as_one_op_and_replays_it():
    from mhc_cg.lab.emulation.backends import get_backend

    backend = get_backend("tape")
    n, c = 4, 6
    hc = make_hc(n, c)
    x = torch.randn(S, B, n * c)
    w = torch.rand(c) + 0.5
    seed = torch.tensor(5)
    graph = backend.new_graph()
    with graph.capture():
        out = fused_sublayer(hc, x, w, seed, 0.2, 0)
    names = [str(op.func) for op in graph.ops]
    for op in ("pre", "post"):
        assert names.count(f"mhc_cg.{op}.default") == 1, names
    assert not [name for name in names if name.startswith("aten.div")], names  # Sinkhorn is inside
    x.copy_(torch.randn(S, B, n * c))
    seed.fill_(6)
    graph.replay()
    assert torch.equal(out, fused_sublayer(hc, x, w, seed, 0.2, 0))


# ---- kernel launches per layer per training step -----------------------------------------------

TINY = dict(vocab_size=64, seq_length=16, hidden_size=32, num_heads=4, num_layers=4, num_streams=4,
            hidden_dropout=0.1, recompute="block", recompute_layers=2)


def test_kernel_launching_ops_per_layer_per_step_at_most_120():
    per_layer, ops = kernels_per_layer(MHCGPTConfig(**TINY))
    print(f"kernel-launching ops per layer per step: {per_layer}; by op: {dict(ops)}")
    assert per_layer <= 120, ops
    assert ops["mhc_cg.pre_backward"] > 0 and ops["mhc_cg.post_backward"] > 0
    # every pre but the chain's first reads the state its post computed (the chain's ends, one
    # plain pre and post, cancel in the difference)
    assert ops["mhc_cg.post_state"] > 0 and ops["mhc_cg.pre_from_state"] > 0


def test_kernel_counter_sees_the_composed_sublayer():
    """The counter counts every aten op: the composed sublayer alone launches hundreds, the fused
    one a pre (its state's two stages and its F-input pass) and its backward (two kernels), the
    post's mappings and the post (one each);
    the post's backward is split between the pre's backward (its reductions) and, at the chain's
    end, one kernel for F's output gradient."""
    hc = make_hc(4, 8)
    x = torch.randn(S, B, 32, requires_grad=True)
    w = torch.rand(8) + 0.5
    with KernelCounter() as fused_count:
        fused_sublayer(hc, x, w, None, 0.0, 0).sum().backward()
    with KernelCounter() as composed_count:
        composed_sublayer(hc, x, w, None, 0.0, 0).sum().backward()
    assert composed_count.counts["aten.div"] >= 2 * 20 * 2  # 2 divisions per iteration, fwd + bwd
    assert composed_count.total > 10 * fused_count.total
    launches = {"pre": 3, "pre_backward": 2, "post_maps": 1, "post": 1, "post_grad_y": 1,
                "post_backward": 0}
    assert {op: fused_count.counts[f"mhc_cg.{op}"] for op in launches} == launches


# ---- every mode bit-identical with the Triton kernels (interpreter) -----------------------------

TINY_TRITON_YAML = """\
model: {vocab_size: 16, seq_length: 4, hidden_size: 8, num_heads: 2, num_layers: 2, num_streams: 4,
        hidden_dropout: 0.1, dropout_impl: counter, recompute: block, recompute_layers: 1,
        sinkhorn_iterations: 4, kernels: triton}
train: {steps: 3, micro_batch_size: 1, lr: 0.003, seed: 1234, device: cpu}
graph: {backend: auto, cuda_graph_scope: [attn, mlp, mhc_recompute]}
"""


@needs_triton
@pytest.mark.slow
def test_compare_with_triton_kernels_every_mode_bit_identical(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("runs the interpreter on CPU")
    cfg = tmp_path / "tiny_triton.yaml"  # 4 tokens, 4 Sinkhorn iterations: the interpreter is slow
    cfg.write_text(TINY_TRITON_YAML)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "mhc_cg.cli", "train", "--config", str(cfg),
                           "--compare", "--json", "--steps", "2", "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modes = json.loads(proc.stdout)["modes"]
    assert set(modes) == set(compared_modes())
    ref = modes["eager_none"]
    for name, mode in modes.items():
        assert mode["losses"] == ref["losses"], name
        assert mode["grad_norms"] == ref["grad_norms"], name
    assert len(ref["losses"]) == 2  # the second step replays what the first left


# ---- GPU: Triton against the torch reference, timed ----------------------------------------------

def _time_ms(fn, reps=20) -> float:
    fn()  # warm-up: Triton's compile
    torch.cuda.synchronize()
    return time_repeated(fn, reps, torch.device("cuda")) * 1e3


@pytest.mark.cuda
def test_cuda_triton_kernels_timed_against_reference():
    """Each Triton kernel against the torch reference on CUDA (bf16, 4096 tokens, n=4, C=4096)."""
    if not torch.cuda.is_available() or not triton_installed():
        pytest.skip("needs a CUDA GPU and triton")
    for name, run in op_cases("cuda", torch.bfloat16, 4, 4096, t=4096).items():
        for got, want in zip(_as_tuple(run(True)), _as_tuple(run(False))):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"{name}: {m}")
        ref_ms, tri_ms = _time_ms(lambda: run(False)), _time_ms(lambda: run(True))
        print(f"{name:22s} torch {ref_ms:8.3f} ms  triton {tri_ms:8.3f} ms  speed-up {ref_ms / tri_ms:6.1f}x")


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("ht", [False, True])
def test_pre_backward_with_the_posts_halves_is_bit_identical_to_them_apart(request, use_triton,
                                                                           ht):
    """The pre's backward doing its post's reductions and the previous post's F output gradient
    gives the very bits of the ops apart: the post's backward, then the pre's given its state
    gradient, then the previous post's g_y from the x gradient written (so every mode rounds
    alike whichever way a sublayer runs)."""
    from mhc_cg.ops.kernels import custom_ops as ops

    if use_triton:
        request.getfixturevalue("interpret")
    n, c, t, p = 4, 24, 6, 0.2
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    m = n * n + 2 * n
    x, y, w, bias, nw = rand(t, n * c), rand(t, c), rand(m, n * c) * 0.3, rand(m), rand(c) + 1
    alphas = [torch.full((1,), v, dtype=torch.bfloat16) for v in (0.7, -0.4, 1.3)]
    seed = torch.tensor(3)
    state = reference.pre(x, w, *alphas, bias, nw, n, 20, EPS)[1]
    prev_state = reference.pre(y.repeat(1, n), w, *alphas, bias, nw, n, 20, EPS)[1]
    g_state, g_out, g_post = torch.randn(t, m + 2, generator=g), rand(t, c), rand(t, n * c)
    common = (x, w, *alphas, bias, nw, state, n, 20, EPS, use_triton, ht)

    g_st_post, params_post, _ = ops.post_backward(g_post, x, state, *alphas, bias, y, seed, p, 3,
                                                  n, 20, use_triton, ht)
    # the state's gradient from its other consumers, or none (the model's case: the post is its
    # one consumer, and no zeros are made for the others)
    for g_in, g_st_apart in ((g_state, g_state + g_st_post), (None, g_st_post)):
        apart = g_post.clone()
        w_apart, params_apart, nw_apart = ops.pre_backward_into(g_out, g_st_apart, apart,
                                                                *common)
        g_y_apart = ops.post_grad_y(apart, prev_state, alphas[1] * 0.5, bias.flip(0), seed, p,
                                    5, n, torch.bfloat16, use_triton)

        fused, g_y = g_post.clone(), torch.empty_like(y)
        w_fused, params_fused, nw_fused = ops.pre_backward_into(
            g_out, g_in, fused, *common, y, seed, p, 3, prev_state, alphas[1] * 0.5,
            bias.flip(0), 5, g_y)
        assert torch.equal(fused, apart) and torch.equal(g_y, g_y_apart)
        assert torch.equal(w_fused, w_apart) and torch.equal(nw_fused, nw_apart)
        assert torch.equal(params_fused, params_apart + params_post)
    assert not torch.equal(g_y, torch.zeros_like(g_y))


# ---- dev's (DeepSeek-V4's) arithmetic: h_pre = sigmoid + 1e-6, dev's Sinkhorn -------------------

# every op whose results dev's arithmetic changes, and the output that shows it
DEV_OPS = {"pre": 0, "pre_backward": 0, "pre_backward_into": -1, "post_maps": 0,
           "post_backward": 0, "pre_backward_fused": 1}


@needs_triton
@pytest.mark.parametrize("dtype,n,c,t,norm,tol", [(torch.float32, 4, 24, 6, True, 1e-5),
                                                  (torch.float32, 3, 10, 5, False, 1e-5),
                                                  (torch.bfloat16, 4, 24, 7, True, 2e-2)])
def test_dev_arithmetic_triton_ops_match_reference(interpret, dtype, n, c, t, norm, tol):
    """Every op, Triton (a compile-time variant of the same kernels) against the reference, in
    dev's arithmetic with dev's H_res layout; ragged token counts, padded streams (n = 3); and
    the arithmetic matters: main's results differ from dev's where it enters."""
    assert_ops_match(dtype, n, c, t, norm, tol, tol, h_res_transposed=True, arithmetic="dev")
    main, dev = (op_cases("cpu", torch.float32, n, c, t, norm, h_res_transposed=True,
                          arithmetic=a) for a in ("main", "dev"))
    for name, k in DEV_OPS.items():
        a, b = _as_tuple(main[name](False))[k], _as_tuple(dev[name](False))[k]
        assert (a - b).abs().max() > 1e-6, name


def test_dev_arithmetic_fused_sublayer_matches_its_unfused_math_and_gradients():
    """The reference's fused pre and post in dev's arithmetic against HyperConnection's unfused
    ops in dev's arithmetic (autograd through dev's Sinkhorn), fp64: values and every gradient."""
    n, c = 4, 8
    hc = make_hc(n, c, torch.float64, h_res_transposed=True, arithmetic="dev")
    norm_w = torch.rand(c, dtype=torch.float64) + 0.5
    x = torch.randn(5, 3, n * c, dtype=torch.float64, requires_grad=True)
    f = torch.nn.Linear(c, c).double()

    def composed(x):
        h_pre, h_post, h_res = hc.compute_mappings(x)
        agg = hc.aggregate(x, h_pre)
        normed = agg * torch.rsqrt(agg.pow(2).mean(-1, keepdim=True) + EPS) * norm_w
        return hc.apply_h_res(h_res, x) + hc.apply_h_post(f(normed), h_post)

    def fused_path(x):
        fn_input, state, x_on = hc.pre(x, norm_w, EPS)
        return hc.post(x_on, state, f(fn_input), None, 0.0, 0)

    probe = torch.randn(5, 3, n * c, dtype=torch.float64)
    results = []
    for run in (composed, fused_path):
        params = [x, *hc.parameters(), *f.parameters()]
        out = run(x)
        results.append((out.detach(), torch.autograd.grad((out * probe).sum(), params)))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    for u, v in zip(gb, ga):
        torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-10)
