"""Helpers several test modules share (``from helpers import ...``: pytest puts tests/ on the path):
small configs, training with gradient capture, a pipeline-order driver, graph-capture helpers,
and running the CLI in a fresh process."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhc_cg.runtime.recompute_captures import capture_recompute_graphs
from mhc_cg.config import RunConfig
from mhc_cg.graphs import GraphCaptureError
from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.model import MHCGPT, MHCGPTConfig
from mhc_cg.core.pipeline_order import peak_in_flight, pipeline_order
from mhc_cg.modes.lifecycle import ModeModel
from mhc_cg.training.run import build_model, prepare
from mhc_cg.lab.resolve import resolve
from mhc_cg.training.session import microbatch_loop
from mhc_cg.runtime.arena import Arena
from mhc_cg.runtime.persistent import PersistentSetPool, new_persistent_set
from mhc_cg.runtime.static import build_static_recompute
from mhc_cg.lab.resolve import train_config


SCOPE_CASES = {
    "attn": (["attn", "mhc_recompute"], None),
    "attn_mlp": (["attn", "mlp", "mhc_recompute"], None),
    "moe_partial": (["attn", "moe_router", "moe_preprocess", "mhc_recompute"], 4),
    "moe_router_only": (["attn", "moe_router", "mhc_recompute"], 4),
}


def small_config(scopes, num_experts=None) -> RunConfig:
    cfg = RunConfig()
    cfg.model = MHCGPTConfig(vocab_size=32, seq_length=16, hidden_size=32, num_heads=4,
                             num_layers=4, hidden_dropout=0.2, recompute_layers=2,
                             num_experts=num_experts, moe_top_k=2, moe_ffn_hidden_size=48)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=4, num_microbatches=2, lr=3e-3,
                                    device="cpu")
    cfg.graph = dataclasses.replace(cfg.graph, backend="tape", cuda_graph_scope=list(scopes))
    return cfg


def grads_per_step(cfg, mode, steps):
    grads = []
    result = train_config(cfg, steps=steps, mode=mode, progress=False,
                   after_backward=lambda step, model: grads.append(
                       {n: p.grad.clone() for n, p in model.named_parameters()
                        if p.grad is not None}))
    return result, grads


def assert_training_identical(cfg, mode, steps):
    """``mode`` trains ``cfg`` exactly as eager without recompute: same losses, gradient norms and
    every parameter's gradient, bit for bit, at every step. Returns ``mode``'s result."""
    reference, ref_grads = grads_per_step(cfg, "eager_none", steps)
    result, got_grads = grads_per_step(cfg, mode, steps)
    assert result.losses == reference.losses
    assert result.grad_norms == reference.grad_norms
    for step, (want, got) in enumerate(zip(ref_grads, got_grads)):
        assert want.keys() == got.keys()
        bad = [n for n in want if not torch.equal(want[n], got[n])]
        assert not bad, f"step {step}: gradients differ for {bad}"
    return result


def assert_training_close(cfg, mode, steps):
    """``mode`` trains ``cfg`` like eager without recompute within a tolerance (on CUDA a capture
    may pick other kernels): losses and every parameter's gradient at every step."""
    reference, ref_grads = grads_per_step(cfg, "eager_none", steps)
    result, got_grads = grads_per_step(cfg, mode, steps)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses),
                               rtol=1e-5, atol=1e-6)
    for want, got in zip(ref_grads, got_grads):
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    return result


PIPELINE_SEQ, PIPELINE_MBS, PIPELINE_LAYERS_PER_CHUNK = 8, 2, 2


def rank_model() -> MHCGPT:
    """The layers one rank holds: two chunks of two layers."""
    torch.manual_seed(0)
    cfg = MHCGPTConfig(vocab_size=16, seq_length=PIPELINE_SEQ, hidden_size=16, num_heads=2,
                       num_layers=2 * PIPELINE_LAYERS_PER_CHUNK, hidden_dropout=0.25)
    return MHCGPT(cfg).train()


def execute(order, chunk_forward, width):
    """Run ``order``; return input grads per (chunk, microbatch) and the forward count."""
    g = torch.Generator().manual_seed(7)
    counts = {1: [0, 0], 2: [0, 0]}  # chunk -> [forwards, backwards]
    live, input_grads = {}, {}
    for entry in order:
        chunk = abs(entry)
        if entry > 0:
            mb = counts[chunk][0]
            counts[chunk][0] += 1
            x = torch.randn(PIPELINE_SEQ, PIPELINE_MBS, width, generator=g).requires_grad_()
            seed = torch.tensor(1000 * chunk + mb)
            live[(chunk, mb)] = (x, chunk_forward(chunk, x, seed))
        else:
            mb = counts[chunk][1]
            counts[chunk][1] += 1
            x, out = live.pop((chunk, mb))
            out.backward(torch.randn(out.shape, generator=g))
            input_grads[(chunk, mb)] = x.grad
    assert not live
    return input_grads


def chunk_layers(model, chunk):
    return list(model.layers)[(chunk - 1) * PIPELINE_LAYERS_PER_CHUNK: chunk * PIPELINE_LAYERS_PER_CHUNK]


def eager_run(order):
    model = rank_model()

    def forward(chunk, x, seed):
        for layer in chunk_layers(model, chunk):
            x = layer(x, seed)
        return x

    width = model.cfg.num_streams * model.cfg.hidden_size
    grads = execute(order, forward, width)
    return model, grads


def static_run(order, block_size, graphs: bool):
    model = rank_model()
    capacity = peak_in_flight(order)
    arena = Arena("cpu")
    sets = PersistentSetPool(capacity, lambda i: new_persistent_set(
        i, chunk_layers(model, 1), block_size, PIPELINE_SEQ, PIPELINE_MBS, "cpu"))
    runtimes = {c: build_static_recompute(chunk_layers(model, c), block_size, seq_length=PIPELINE_SEQ,
                                          micro_batch_size=PIPELINE_MBS, capacity=capacity, device="cpu",
                                          arena=arena, sets=sets) for c in (1, 2)}
    if graphs:
        backend = get_backend("tape")
        for rt in runtimes.values():
            rt.recompute_graphs.update(capture_recompute_graphs(rt, backend))
    acquired = []
    original_acquire = sets.acquire

    def acquire():
        pset = original_acquire()
        acquired.append(pset.index)
        return pset

    sets.acquire = acquire
    width = model.cfg.num_streams * model.cfg.hidden_size
    grads = execute(order, lambda c, x, seed: runtimes[c].forward(x, seed), width)
    return model, grads, runtimes, acquired


def capture_error(backend, body) -> GraphCaptureError:
    graph = backend.new_graph()
    with pytest.raises(GraphCaptureError) as info:
        with graph.capture():
            body()
    return info.value


LAYER_SEQ, LAYER_BATCH = 8, 2


def tiny_layers_config() -> MHCGPTConfig:
    return MHCGPTConfig(vocab_size=32, seq_length=LAYER_SEQ, hidden_size=16, num_heads=2, num_layers=4,
                        num_streams=4, hidden_dropout=0.25, dropout_impl="counter",
                        sinkhorn_iterations=4)


def rank0_interleaved_order() -> list[int]:
    """Rank 0 of pp=2 with 2 virtual chunks and 4 microbatches."""
    return pipeline_order(2, 0, 4, vpp_size=2)


def expected_static_input_sets(order: list[int], layers_per_chunk: list[int], reuse: bool) -> int:
    """Independent walk: a forward takes a released buffer set per layer if one is free, else a
    new one; a chunk's backward releases one set per layer of that chunk."""
    free = allocated = 0
    for code in order:
        layers = layers_per_chunk[abs(code) - 1]
        if code < 0:
            free += layers if reuse else 0
            continue
        for _ in range(layers):
            if free:
                free -= 1
            else:
                allocated += 1
    return allocated


def planner_prediction(order: list[int], layers_per_chunk: list[int], reuse: bool) -> int:
    """The schedule planner's figure, which must agree with the independent walk."""
    walked = expected_static_input_sets(order, layers_per_chunk, reuse)
    try:
        from mhc_cg.lab.planning.planner import count_static_input_buffers
    except ImportError:  # a checkout without the planner
        return walked
    planned = count_static_input_buffers(order, layers_per_chunk, reuse)
    assert planned == walked
    return planned


def drive_pipeline(order, layout, call, xs, seeds, grad_outs):
    """Run ``order`` on one rank: chunk c+1 takes chunk c's output as a received (detached) input.

    ``call(chunk, microbatch, layer, x, seed)`` runs one layer. Returns the last chunk's outputs
    and the first chunk's input grads, per microbatch.
    """
    last = layout.num_chunks - 1
    received, sent = {}, {}
    for is_forward, chunk, mb in layout.passes():
        if is_forward:
            source = xs[mb] if chunk == 0 else sent[(chunk - 1, mb)]
            x = source.detach().requires_grad_()
            h = x
            for layer in range(layout.layers_per_chunk[chunk]):
                h = call(chunk, mb, layer, h, seeds[mb])
            received[(chunk, mb)], sent[(chunk, mb)] = x, h
        else:
            grad = grad_outs[mb] if chunk == last else received[(chunk + 1, mb)].grad
            torch.autograd.backward(sent[(chunk, mb)], grad)
    outputs = [sent[(last, mb)].detach().clone() for mb in range(len(xs))]
    input_grads = [received[(0, mb)].grad.clone() for mb in range(len(xs))]
    return outputs, input_grads


def iteration_data(cfg, num_microbatches, generator):
    width = cfg.num_streams * cfg.hidden_size
    xs = [torch.randn(LAYER_SEQ, LAYER_BATCH, width, generator=generator) for _ in range(num_microbatches)]
    seeds = [torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64, generator=generator)
             for _ in range(num_microbatches)]
    grad_outs = [torch.randn(LAYER_SEQ, LAYER_BATCH, width, generator=generator) for _ in range(num_microbatches)]
    return xs, seeds, grad_outs


def layer_param_grads(layers):
    return {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers)
            for n, p in layer.named_parameters()}


class CountingScale(torch.nn.Module):
    """``x * weight``, counting its Python calls (a side effect a replay must not repeat)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x * self.weight)


REPO = Path(__file__).resolve().parents[1]


def tiny_run_config(*, scopes=("attn", "mlp", "mhc_recompute"), dtype: str = "fp32",
                    steps: int = 3, microbatches: int = 2, **train) -> RunConfig:
    """A tiny mHC GPT that trains in seconds on one CPU thread, dropout on, block recompute."""
    cfg = RunConfig()
    cfg.model = MHCGPTConfig(vocab_size=32, seq_length=8, hidden_size=16, num_heads=2,
                             num_layers=4, num_streams=4, hidden_dropout=0.2,
                             recompute="block", recompute_layers=2)
    cfg.train = dataclasses.replace(cfg.train, steps=steps, micro_batch_size=2,
                                    num_microbatches=microbatches, dtype=dtype, device="cpu",
                                    **train)
    cfg.graph = dataclasses.replace(cfg.graph, backend="auto", cuda_graph_scope=list(scopes))
    return cfg


def write_config(tmp_path: Path, text: str | bytes, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m mhc_cg.cli ARGV`` in a fresh process (exit status, stdout, stderr)."""
    return subprocess.run([sys.executable, "-m", "mhc_cg.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def build_for_mode(cfg, name: str, device) -> ModeModel:
    """The prepared mode ``name`` of ``cfg`` on ``device`` (the config as given), with the
    training step's loop and autograd's own backward (no optimizer)."""
    run = resolve(cfg, name, device)
    loop = functools.partial(microbatch_loop, kernels=run.cfg.model.kernels,
                             backward=torch.autograd.backward)
    return prepare(run, build_model(run), step_loop=loop)
