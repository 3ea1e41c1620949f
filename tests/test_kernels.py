"""Fused mHC ops: torch reference against the composed torch math, Triton (interpreter on CPU)
against the reference, dropout masks bit-exact, one op per step under the graph tape, and the
kernel-launch count of a training step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mhc_cg.ops import kernels as fused
from mhc_cg.ops.dropout import counter_dropout_mask
from mhc_cg.core.errors import ConfigError
from mhc_cg.tools.compare import compared_modes
from mhc_cg.ops.hyper_connection import HyperConnection
from mhc_cg.ops.kernels.dispatch import triton_installed
from mhc_cg.model import MHCGPTConfig
from helpers import mappings_unfused
from kernel_count import KernelCounter, kernels_per_layer

ROOT = Path(__file__).resolve().parents[1]
S, B = 3, 2
needs_triton = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")


@pytest.fixture
def interpret():
    """Triton's interpreter on CPU: tests/conftest.py sets TRITON_INTERPRET=1 before triton loads."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the Triton kernels are compared on CUDA tensors (cuda-marked tests)")
    if os.environ.get("TRITON_INTERPRET") != "1" or not fused.dispatch.triton_kernels().INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")


def make_hc(n: int, c: int, dtype=torch.float32, seed=0) -> HyperConnection:
    torch.manual_seed(seed)
    hc = HyperConnection(c, num_streams=n, sinkhorn_iterations=20, init_gating_factor=0.3).to(dtype)
    with torch.no_grad():
        hc.mapping_proj.weight.normal_(std=0.5)
        hc.bias.normal_()
        hc.alpha_pre.fill_(0.7)
        hc.alpha_post.fill_(-0.4)
        hc.alpha_res.fill_(1.3)
    return hc


def sublayer_ops(hc: HyperConnection, x, y, seed, p, kernels):
    """Every fused op of one sublayer, forward; returns the outputs (all differentiable)."""
    hc.kernels = kernels
    h_pre, h_post, h_res = hc.compute_mappings(x)
    agg = hc.aggregate(x, h_pre)
    weight = torch.linspace(0.5, 1.5, agg.shape[-1], dtype=x.dtype).requires_grad_()
    normed = fused.rms_norm(agg, weight, 1e-5, kernels)
    mixed = hc.apply_h_res(h_res, x)
    out = hc.post_bda(y, h_post, mixed, seed, p, stream=5)
    return [h_pre, h_post, h_res, agg, normed, mixed, out], weight


def run_sublayer(n, c, dtype, kernels, p=0.25):
    hc = make_hc(n, c, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, B, n * c, generator=g).to(dtype).requires_grad_()
    y = torch.randn(S, B, c, generator=g).to(dtype).requires_grad_()
    outs, weight = sublayer_ops(hc, x, y, torch.tensor(77), p, kernels)
    grads_out = [torch.randn(o.shape, generator=g).to(dtype) for o in outs]
    params = [x, y, weight, *hc.parameters()]
    grads = torch.autograd.grad(outs, params, grads_out)
    return [o.detach() for o in outs], list(grads)


# ---- the torch reference against the composed torch math ---------------------------------------

@pytest.mark.parametrize("n", [1, 3, 4])
def test_reference_matches_composed_math_and_its_gradients(n):
    hc, c = make_hc(n, 5, torch.float64), 5
    x = torch.randn(S, B, n * c, dtype=torch.float64, requires_grad=True)
    fused_out = hc.compute_mappings(x)
    composed = mappings_unfused(hc, x)
    g = [torch.randn_like(o) for o in composed]
    params = [x, *hc.parameters()]
    want = torch.autograd.grad(composed, params, g)
    got = torch.autograd.grad(fused_out, params, g)
    for a, b in zip(fused_out, composed):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_reference_ops_pass_gradcheck():
    n, c = 3, 4
    hc = make_hc(n, c, torch.float64)
    x = torch.randn(2, 1, n * c, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 1, c, dtype=torch.float64, requires_grad=True)
    h_post = torch.rand(2, 1, n, dtype=torch.float64, requires_grad=True)
    h_res = torch.rand(2, 1, n, n, dtype=torch.float64, requires_grad=True)
    w = torch.rand(c, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor(3)
    assert torch.autograd.gradcheck(lambda a, b: hc.aggregate(a, b), (x, h_post))
    assert torch.autograd.gradcheck(lambda a, b: hc.apply_h_res(a, b), (h_res, x))
    assert torch.autograd.gradcheck(lambda a, b, m: hc.post_bda(a, b, m, seed, 0.3, 1), (y, h_post, x))
    assert torch.autograd.gradcheck(lambda a, b: fused.rms_norm(a, b, 1e-5), (y, w))


def test_post_bda_mask_is_mhc_cg_dropout_mask():
    n, c, p = 4, 7, 0.3
    seed = torch.tensor(2024)
    hc = make_hc(n, c)
    ones_y, ones_h = torch.ones(S, B, c), torch.ones(S, B, n)
    out = hc.post_bda(ones_y, ones_h, torch.zeros(S, B, n * c), seed, p, stream=9)
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

@needs_triton
@pytest.mark.parametrize("n,c", [(1, 6), (2, 12), (3, 10), (4, 24), (8, 5)])
def test_triton_matches_reference_fp32(interpret, n, c):
    want_out, want_grads = run_sublayer(n, c, torch.float32, "torch")
    got_out, got_grads = run_sublayer(n, c, torch.float32, "triton")
    for i, (a, b) in enumerate(zip(got_out, want_out)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"output {i}: {m}")
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"gradient {i}: {m}")


def op_cases(device, dtype, n: int, c: int, t: int) -> dict:
    """Every forward and backward op on the same random inputs; ``case(use_triton)`` runs one."""
    from mhc_cg.ops.kernels import ops

    g = torch.Generator().manual_seed(0)

    def rand(*shape, lo=None):
        r = torch.randn(*shape, generator=g) if lo is None else torch.rand(*shape, generator=g) + lo
        return r.to(device=device, dtype=dtype)

    m = n * n + 2 * n
    proj, xnorm, bias = rand(t, m), rand(t, lo=1.0), rand(m)
    alphas = [torch.full((1,), v, device=device, dtype=dtype) for v in (0.7, -0.4, 1.3)]
    x, y, w = rand(t, n * c), rand(t, c), rand(c, lo=0.5)
    h, h_res = rand(t, n, lo=0.0), rand(t, n, n, lo=0.0)
    g_map = [rand(t, n), rand(t, n), rand(t, n, n)]
    seed, sqrt_d = torch.tensor(3, device=device), float(n * c) ** 0.5
    return {
        "mappings": lambda tri: ops.mappings(proj, xnorm, *alphas, bias, n, 20, sqrt_d, tri),
        "mappings_backward": lambda tri: ops.mappings_backward(*g_map, proj, xnorm, *alphas, bias, n,
                                                               20, sqrt_d, tri),
        "aggregate": lambda tri: ops.aggregate(x, h, tri),
        "aggregate_backward": lambda tri: ops.aggregate_backward(y, x, h, tri),
        "h_res_apply": lambda tri: ops.h_res_apply(h_res, x, tri),
        "h_res_apply_backward": lambda tri: ops.h_res_apply_backward(x, h_res, x, tri),
        "post_bda": lambda tri: ops.post_bda(y, h, x, seed, 0.1, 3, tri),
        "post_bda_backward": lambda tri: ops.post_bda_backward(x, y, h, seed, 0.1, 3, tri),
        "rms_norm": lambda tri: ops.rms_norm(y, w, 1e-5, tri),
        "rms_norm_backward": lambda tri: ops.rms_norm_backward(x[:, :c].contiguous(), y, w, 1e-5, tri),
    }


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@needs_triton
@pytest.mark.parametrize("n,c", [(3, 10), (4, 24), (8, 5)])
def test_triton_matches_reference_bf16(interpret, n, c):
    """Each op on the same bf16 inputs: both compute in fp32 and round once to bf16."""
    for name, run in op_cases("cpu", torch.bfloat16, n, c, t=6).items():
        for got, want in zip(_as_tuple(run(True)), _as_tuple(run(False))):
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2,
                                       msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_dropout_mask_bit_exact(interpret, p):
    n, c = 3, 37  # odd widths: masks cross C-blocks and streams
    hc = make_hc(n, c)
    hc.kernels = "triton"
    for seed, stream in [(0, 0), (123456789, 3), (2 ** 31 - 2, 41)]:
        seed_t = torch.tensor(seed)
        out = hc.post_bda(torch.ones(4, 2, c), torch.ones(4, 2, n), torch.zeros(4, 2, n * c), seed_t,
                          p, stream)
        assert torch.equal(out, counter_dropout_mask(seed_t, stream, out.shape, p, torch.float32))
        # the backward regenerates the same mask: d out / d y = sum over streams of the kept scale
        y = torch.ones(4, 2, c, requires_grad=True)
        hc.post_bda(y, torch.ones(4, 2, n), torch.zeros(4, 2, n * c), seed_t, p, stream).sum().backward()
        assert torch.equal(y.grad, out.view(4, 2, n, c).sum(2))


def test_triton_on_cpu_without_interpreter_is_a_config_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: model.kernels: triton is valid here")
    with pytest.raises(ConfigError, match="model.kernels: 'triton' on CPU runs only in Triton's interpreter"):
        MHCGPTConfig(kernels="triton")
    with pytest.raises(ConfigError, match="model.kernels: must be one of"):
        MHCGPTConfig(kernels="cuda")
    hc = make_hc(2, 4)
    hc.kernels = "triton"
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        hc.compute_mappings(torch.randn(1, 1, 8))


def test_cli_rejects_triton_on_cpu_with_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: model.kernels: triton is valid here")
    cfg = tmp_path / "k.yaml"
    cfg.write_text("model: {kernels: triton}\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "mhc_cg.cli", "config", "check", str(cfg)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "model.kernels: 'triton' on CPU runs only in Triton's interpreter" in proc.stderr


# ---- one op per step: what the graph tape records ----------------------------------------------

def test_tape_records_each_fused_op_as_one_op_and_replays_it():
    from mhc_cg.runtime.graphs import get_backend

    backend = get_backend("tape")
    n, c = 4, 6
    hc = make_hc(n, c)
    x = torch.randn(S, B, n * c)
    y = torch.randn(S, B, c)
    seed = torch.tensor(5)
    graph = backend.new_graph()
    with graph.capture():
        h_pre, h_post, h_res = hc.compute_mappings(x)
        out = hc.post_bda(y, h_post, hc.apply_h_res(h_res, x), seed, 0.2, 0) + hc.aggregate(x, h_pre).sum()
    names = [str(op.func) for op in graph.ops]
    for op in ("mappings", "aggregate", "h_res_apply", "post_bda"):
        assert names.count(f"mhc_cg.{op}.default") == 1, names
    assert not [name for name in names if name.startswith("aten.div")], names  # Sinkhorn is inside
    x.copy_(torch.randn(S, B, n * c))
    seed.fill_(6)
    graph.replay()
    h_pre, h_post, h_res = hc.compute_mappings(x)
    want = hc.post_bda(y, h_post, hc.apply_h_res(h_res, x), seed, 0.2, 0) + hc.aggregate(x, h_pre).sum()
    assert torch.equal(out, want)


# ---- kernel launches per layer per training step -----------------------------------------------

TINY = dict(vocab_size=64, seq_length=16, hidden_size=32, num_heads=4, num_layers=4, num_streams=4,
            hidden_dropout=0.1, recompute="block", recompute_layers=2)


def test_kernel_launching_ops_per_layer_per_step_at_most_120():
    per_layer, ops = kernels_per_layer(MHCGPTConfig(**TINY))
    print(f"kernel-launching ops per layer per step: {per_layer}; by op: {dict(ops)}")
    assert per_layer <= 120, ops
    for op in ("mappings", "aggregate", "h_res_apply", "post_bda", "rms_norm"):
        assert ops[f"mhc_cg.{op}"] > 0 and ops[f"mhc_cg.{op}_backward"] > 0


def test_kernel_counter_sees_the_unfused_sinkhorn():
    """The counter counts every aten op: the composed mappings alone launch hundreds."""
    hc = make_hc(4, 8)
    x = torch.randn(S, B, 32, requires_grad=True)
    with KernelCounter() as fused_count:
        torch.autograd.grad(hc.compute_mappings(x), x, [torch.ones(S, B, 4)] * 2 + [torch.ones(S, B, 4, 4)])
    with KernelCounter() as composed_count:
        torch.autograd.grad(mappings_unfused(hc, x), x,
                            [torch.ones(S, B, 4)] * 2 + [torch.ones(S, B, 4, 4)])
    assert composed_count.counts["aten.div"] >= 2 * 20 * 2  # 2 divisions per iteration, fwd + bwd
    assert composed_count.total > 10 * fused_count.total
    assert fused_count.counts["mhc_cg.mappings"] == 1 and fused_count.counts["mhc_cg.mappings_backward"] == 1


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
                           "--compare", "--json", "--steps", "3", "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modes = json.loads(proc.stdout)["modes"]
    assert set(modes) == set(compared_modes())
    ref = modes["eager_none"]
    for name, mode in modes.items():
        assert mode["losses"] == ref["losses"], name
        assert mode["grad_norms"] == ref["grad_norms"], name
    assert len(ref["losses"]) == 3


# ---- GPU: Triton against the torch reference, timed ----------------------------------------------

def _time_ms(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


@pytest.mark.cuda
def test_cuda_triton_kernels_timed_against_reference():
    """Each Triton kernel against the torch reference on CUDA (bf16, 4096 tokens, n=4, C=4096)."""
    if not torch.cuda.is_available() or not triton_installed():
        pytest.skip("needs a CUDA GPU and triton")
    for name, run in op_cases("cuda", torch.bfloat16, 4, 4096, t=4096).items():
        for got, want in zip(_as_tuple(run(True)), _as_tuple(run(False))):
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2,
                                       msg=lambda m: f"{name}: {m}")
        ref_ms, tri_ms = _time_ms(lambda: run(False)), _time_ms(lambda: run(True))
        print(f"{name:22s} torch {ref_ms:8.3f} ms  triton {tri_ms:8.3f} ms  speed-up {ref_ms / tri_ms:6.1f}x")
