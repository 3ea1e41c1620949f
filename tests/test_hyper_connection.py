"""mHC math against a straightforward loop-per-stream reference written here."""

import math

import pytest
import torch

from mhc_cg.ops.hyper_connection import (HyperConnection, contract_streams, expand_streams,
                                     sinkhorn_knopp)

S, B, N, C = 3, 2, 4, 5


def make_hc(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    hc = HyperConnection(C, num_streams=N, sinkhorn_iterations=20, init_gating_factor=0.3).to(dtype)
    with torch.no_grad():  # non-trivial gating and bias so every branch of the maths matters
        hc.bias.normal_()
        hc.alpha_pre.fill_(0.7)
        hc.alpha_post.fill_(-0.4)
        hc.alpha_res.fill_(1.3)
    return hc


def streams(dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, N * C, generator=g, dtype=dtype)


# ---- the reference: one token at a time, one stream at a time -------------------------------

def ref_sinkhorn(logits, iterations):
    m = [[math.exp(v - max(row)) for v in row] for row in logits]
    n = len(m)
    for _ in range(iterations):
        for i in range(n):
            total = max(sum(m[i]), 1e-6)
            m[i] = [v / total for v in m[i]]
        for j in range(n):
            total = max(sum(m[i][j] for i in range(n)), 1e-6)
            for i in range(n):
                m[i][j] /= total
    return m


def ref_token_mappings(hc, x_tok):
    """x_tok: list of n*C floats -> (h_pre, h_post, h_res) as python lists."""
    n = hc.num_streams
    rms = math.sqrt(sum(v * v for v in x_tok) / len(x_tok))
    r = 1.0 / (rms + 1e-6)
    w = hc.mapping_proj.weight.tolist()
    proj = [sum(wk * xk for wk, xk in zip(row, x_tok)) for row in w]
    alphas = [hc.alpha_pre.item()] * n + [hc.alpha_post.item()] * n + [hc.alpha_res.item()] * (n * n)
    bias = hc.bias.tolist()
    h = [r * p * a + b for p, a, b in zip(proj, alphas, bias)]
    sig = lambda v: 1.0 / (1.0 + math.exp(-v))
    h_pre = [sig(v) for v in h[:n]]
    h_post = [2.0 * sig(v) for v in h[n:2 * n]]
    logits = [h[2 * n + i * n: 2 * n + (i + 1) * n] for i in range(n)]
    return h_pre, h_post, ref_sinkhorn(logits, hc.sinkhorn_iterations)


def stream(x_tok, i):
    return x_tok[i * C:(i + 1) * C]


def test_compute_mappings_matches_reference():
    hc, x = make_hc(), streams()
    h_pre, h_post, h_res = hc.compute_mappings(x)
    assert h_pre.shape == (S, B, N) and h_post.shape == (S, B, N) and h_res.shape == (S, B, N, N)
    for s in range(S):
        for b in range(B):
            rp, rq, rr = ref_token_mappings(hc, x[s, b].tolist())
            torch.testing.assert_close(h_pre[s, b], torch.tensor(rp, dtype=x.dtype))
            torch.testing.assert_close(h_post[s, b], torch.tensor(rq, dtype=x.dtype))
            torch.testing.assert_close(h_res[s, b], torch.tensor(rr, dtype=x.dtype))


def test_aggregate_apply_h_res_apply_h_post_match_reference():
    hc, x = make_hc(), streams()
    h_pre, h_post, h_res = hc.compute_mappings(x)
    y = torch.randn(S, B, C, dtype=x.dtype)
    agg, mixed, post = hc.aggregate(x, h_pre), hc.apply_h_res(h_res, x), hc.apply_h_post(y, h_post)
    for s in range(S):
        for b in range(B):
            tok = x[s, b].tolist()
            want_agg = [sum(h_pre[s, b, i].item() * stream(tok, i)[k] for i in range(N)) for k in range(C)]
            torch.testing.assert_close(agg[s, b], torch.tensor(want_agg, dtype=x.dtype))
            for i in range(N):
                want_mix = [sum(h_res[s, b, i, j].item() * stream(tok, j)[k] for j in range(N))
                            for k in range(C)]
                torch.testing.assert_close(mixed[s, b, i * C:(i + 1) * C], torch.tensor(want_mix, dtype=x.dtype))
                torch.testing.assert_close(post[s, b, i * C:(i + 1) * C], h_post[s, b, i] * y[s, b])


def test_h_res_is_doubly_stochastic_and_non_negative():
    hc, x = make_hc(), streams()
    _, _, h_res = hc.compute_mappings(x)
    ones = torch.ones(S, B, N, dtype=h_res.dtype)
    assert (h_res >= 0).all()
    # The last step normalises columns, so they are exact; rows converge with the iterations.
    torch.testing.assert_close(h_res.sum(-2), ones, atol=1e-12, rtol=0)
    torch.testing.assert_close(h_res.sum(-1), ones, atol=2e-2, rtol=0)
    hc.sinkhorn_iterations = 500
    _, _, converged = hc.compute_mappings(x)
    torch.testing.assert_close(converged.sum(-1), ones, atol=1e-9, rtol=0)


def test_non_symmetric_h_res_mixes_in_documented_direction():
    # out[i] = sum_j h_res[i, j] * x[j]: with h_res[0, 1] = 1 stream 1 flows into output stream 0.
    hc = HyperConnection(C, num_streams=2)
    x = torch.cat([torch.full((1, 1, C), 10.0), torch.full((1, 1, C), 20.0)], dim=-1)
    h_res = torch.tensor([[[[0.0, 1.0], [0.0, 0.0]]]])
    out = hc.apply_h_res(h_res, x)
    assert torch.equal(out[..., :C], torch.full((1, 1, C), 20.0))
    assert torch.equal(out[..., C:], torch.zeros(1, 1, C))


def test_expand_and_contract_streams():
    x = torch.randn(S, B, C)
    wide = expand_streams(x, N)
    assert wide.shape == (S, B, N * C)
    for i in range(N):
        assert torch.equal(wide[..., i * C:(i + 1) * C], x)
    assert torch.allclose(contract_streams(wide, N), x)
    mixed = torch.randn(S, B, N * C)
    want = sum(mixed[..., i * C:(i + 1) * C] for i in range(N)) / N
    torch.testing.assert_close(contract_streams(mixed, N), want)


# ---- gradients, float64 -------------------------------------------------------------------------

def test_gradcheck_sinkhorn():
    logits = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda l: sinkhorn_knopp(l, 7), (logits,))


def test_sinkhorn_saves_only_logits():
    logits = torch.randn(4, 3, 3, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        sinkhorn_knopp(logits, 20)
    assert sum(saved) == logits.numel()


def test_gradcheck_compute_mappings_wrt_input_and_every_parameter():
    hc, x = make_hc(), streams().requires_grad_(True)
    names = [name for name, _ in hc.named_parameters()]
    assert sorted(names) == ["alpha_post", "alpha_pre", "alpha_res", "bias", "mapping_proj.weight"]
    leaves = [p.detach().clone().requires_grad_(True) for p in hc.parameters()]

    def fn(x, *ps):
        return torch.func.functional_call(hc, dict(zip(names, ps)), (x,), strict=True)

    hc.forward = hc.compute_mappings  # functional_call drives forward
    assert torch.autograd.gradcheck(fn, (x, *leaves))


@pytest.mark.parametrize("op", ["aggregate", "apply_h_res", "apply_h_post", "expand", "contract"])
def test_gradcheck_stream_ops(op):
    hc = make_hc()
    x = streams().requires_grad_(True)
    h_pre = torch.rand(S, B, N, dtype=torch.float64, requires_grad=True)
    h_res = torch.rand(S, B, N, N, dtype=torch.float64, requires_grad=True)
    y = torch.randn(S, B, C, dtype=torch.float64, requires_grad=True)
    cases = {
        "aggregate": (hc.aggregate, (x, h_pre)),
        "apply_h_res": (hc.apply_h_res, (h_res, x)),
        "apply_h_post": (hc.apply_h_post, (y, h_pre)),
        "expand": (lambda t: expand_streams(t, N), (y,)),
        "contract": (lambda t: contract_streams(t, N), (x,)),
    }
    fn, args = cases[op]
    assert torch.autograd.gradcheck(fn, args)


# ---- bad shapes -----------------------------------------------------------------------------------

def test_bad_shapes_name_the_expected_shape():
    hc = make_hc(torch.float32)
    with pytest.raises(ValueError, match=r"\[\*, \*, 20\]"):
        hc.compute_mappings(torch.randn(S, B, 3 * C))
    with pytest.raises(ValueError, match=r"\[s, b, n\*C\]"):
        hc.compute_mappings(torch.randn(B, N * C))
    with pytest.raises(ValueError, match=r"\[3, 2, 4\]"):
        hc.aggregate(torch.randn(S, B, N * C), torch.rand(S, B, N + 1))
    with pytest.raises(ValueError, match=r"\[3, 2, 4, 4\]"):
        hc.apply_h_res(torch.rand(S, B, N, N - 1), torch.randn(S, B, N * C))
    with pytest.raises(ValueError, match=r"\[s, b, C\] = \[\*, \*, 5\]"):
        hc.apply_h_post(torch.randn(S, B, C + 1), torch.rand(S, B, N))
    with pytest.raises(ValueError, match=r"\[\.\.\., n, n\]"):
        sinkhorn_knopp(torch.randn(3, 4), 5)


def test_buffers_the_stream_ops_write_are_checked():
    """The expand's ``out`` and the contraction's ``grad_into`` are written whole: one that is
    not contiguous, of the stream's shape and dtype, is refused in one line naming it."""
    x = torch.randn(S, B, C)
    with pytest.raises(ValueError, match=r"expand_streams: out must be a contiguous .* shape "
                                         rf"\({S}, {B}, {N * C}\)"):
        expand_streams(x, N, torch.empty(S, B, N * C + 1))
    stream = torch.randn(S, B, N * C, requires_grad=True)
    with pytest.raises(ValueError, match=r"contract_streams: grad_into must be a contiguous"):
        contract_streams(stream, N, torch.empty(B, S, N * C).transpose(0, 1))
    with pytest.raises(ValueError, match=r"contract_streams: grad_into"):
        contract_streams(stream, N, torch.empty(S, B, N * C, dtype=torch.float64))
    into = torch.empty(S, B, N * C)
    contract_streams(stream, N, into).sum().backward()
    torch.testing.assert_close(into, torch.full_like(into, 1 / N))  # the mean's gradient, there


def test_the_expand_writes_its_gradient_into_the_buffer_lent_for_it():
    """The expand's backward sums the streams' gradient into ``grad_into`` (the static runtime's
    idle arena): the same bits as the sum it would allocate, refused for a leaf (whose ``.grad``
    would keep the buffer) and for a buffer of another shape."""
    leaf = torch.randn(S, B, C, requires_grad=True)
    g = torch.randn(S, B, N * C)
    expand_streams(leaf * 1, N).backward(g)
    into = torch.full((S, B, C), float("nan"))
    expand_streams(leaf * 1, N, grad_into=into).backward(g)
    assert torch.equal(into, g.view(S, B, N, C).sum(-2))
    assert torch.equal(into, leaf.grad / 2)  # the leaf got both gradients through the product
    with pytest.raises(ValueError, match="expand_streams: grad_into needs an x made by an op"):
        expand_streams(leaf, N, grad_into=into)
    with pytest.raises(ValueError, match=r"expand_streams: grad_into must be a contiguous"):
        expand_streams(leaf * 1, N, grad_into=torch.empty(S, B, C + 1))
