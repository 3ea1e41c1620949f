"""Helpers several test modules share: small configs, training with gradient capture, a
pipeline-order driver, and the graph-semantics checks that run on every backend."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from mhc_cg.config import RunConfig
from mhc_cg.graphs import (GraphCaptureError, GraphReplayError, count_allocated_static_inputs,
                           get_backend, make_graphed_callables)
from mhc_cg.graphs.graphed_callables import order_layout
from mhc_cg.model import MHCGPT, MHCGPTConfig, MHCTransformerLayer
from mhc_cg.pipeline.planner import peak_in_flight
from mhc_cg.pipeline.schedule import pipeline_order
from mhc_cg.recompute.arena import Arena
from mhc_cg.recompute.persistent import PersistentSetPool, new_persistent_set
from mhc_cg.recompute.static import build_static_recompute
from mhc_cg.train import train


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
    result = train(cfg, steps=steps, mode=mode, progress=False,
                   after_backward=lambda step, model: grads.append(
                       {n: p.grad.clone() for n, p in model.named_parameters()
                        if p.grad is not None}))
    return result, grads


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
            rt.capture_recompute_graphs(backend)
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


def device_of(backend) -> str:
    return backend.device


def check_replay_reruns_ops_without_python(backend):
    dev = device_of(backend)
    x = torch.randn(4, 3, device=dev)
    w = torch.randn(3, 5, device=dev)
    side_effects = []
    graph = backend.new_graph()
    with graph.capture():
        side_effects.append("ran")
        y = torch.relu(x @ w).sum(0) * 2.0
        y.add_(1.0)
    backend.synchronize()
    assert side_effects == ["ran"]
    for _ in range(2):
        x.copy_(torch.randn(4, 3, device=dev))
        graph.replay()
        backend.synchronize()
        assert torch.equal(y, torch.relu(x @ w).sum(0) * 2.0 + 1.0)
    assert side_effects == ["ran"], "Python in the captured body must not run at replay"
    assert graph.stats.violations == 0


def check_backward_captured_with_autograd_grad(backend):
    dev = device_of(backend)
    x = torch.randn(6, 4, device=dev)
    w = torch.randn(4, 4, device=dev, requires_grad=True)
    grad_out = torch.randn(6, 4, device=dev)
    pool = backend.new_pool()
    fwd, bwd = backend.new_graph(pool=pool), backend.new_graph(pool=pool)
    with fwd.capture():
        out = torch.tanh(x @ w) * torch.sigmoid(x)
    with bwd.capture():
        (grad_w,) = torch.autograd.grad(out, w, grad_out)
    for _ in range(2):
        x.copy_(torch.randn(6, 4, device=dev))
        grad_out.copy_(torch.randn(6, 4, device=dev))
        fwd.replay()
        bwd.replay()
        backend.synchronize()
        w_ref = w.detach().clone().requires_grad_()
        out_ref = torch.tanh(x @ w_ref) * torch.sigmoid(x)
        out_ref.backward(grad_out)
        assert torch.equal(out, out_ref)
        assert torch.equal(grad_w, w_ref.grad)


def check_replay_order_must_equal_capture_order(backend):
    dev = device_of(backend)
    x = torch.randn(3, device=dev)
    pool = backend.new_pool()
    first, second = backend.new_graph(pool=pool), backend.new_graph(pool=pool)
    with first.capture():
        a = x * 2
    with second.capture():
        a * 3
    first.replay()
    second.replay()
    first.replay()  # the cursor wrapped: a new iteration
    with pytest.raises(GraphReplayError, match="replay order differs from capture order"):
        first.replay()
    private = backend.new_graph()
    with private.capture():
        x + 1
    private.replay()
    private.replay()  # a private pool holds one graph: any order is its order


def capture_error(backend, body) -> GraphCaptureError:
    graph = backend.new_graph()
    with pytest.raises(GraphCaptureError) as info:
        with graph.capture():
            body()
    return info.value


ILLEGAL_BODIES = {
    "item": (lambda x: x.sum().item(), "_local_scalar_dense"),
    "tolist": (lambda x: x.tolist(), "_local_scalar_dense|_to_copy|tolist"),
    "bool": (lambda x: bool(x[0] > 0), "_local_scalar_dense|is_nonzero"),
    "nonzero": (lambda x: torch.nonzero(x > 0), "nonzero"),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), "masked_select"),
    "unique": (lambda x: torch.unique(x), "unique"),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x, (x > 0).long()), "repeat_interleave"),
    "rand": (lambda x: torch.rand(3, device=x.device), "aten.rand"),
    "bernoulli": (lambda x: torch.bernoulli(x.sigmoid()), "bernoulli"),
    "torch_dropout": (lambda x: F.dropout(x, 0.5, training=True), "dropout|bernoulli"),
}


def check_illegal_op_rejected(backend, case):
    body, op_pattern = ILLEGAL_BODIES[case]
    x = torch.randn(8, device=backend.device)
    error = capture_error(backend, lambda: body(x))
    message = str(error)
    assert re.search(op_pattern, message), message
    where = f"{body.__code__.co_filename}:{body.__code__.co_firstlineno}"
    assert where in message, f"the error must point at the user's line {where}: {message}"
    if case in ("rand", "bernoulli", "torch_dropout"):
        assert "mhc_cg.dropout" in message and "counter" in message


def check_storage_resize_of_input_rejected(backend):
    x = torch.randn(16, device=backend.device)

    def body():
        y = x * 2
        x.untyped_storage().resize_(0)  # seed-000 style "free": invisible to a graph
        return y

    error = capture_error(backend, body)
    assert "resized" in str(error) and error.report.resized_storages


def check_resize_op_on_foreign_tensor_rejected(backend):
    x = torch.randn(16, device=backend.device)
    body = lambda: x.resize_(32)  # noqa: E731
    error = capture_error(backend, body)
    assert "aten.resize_" in str(error) and "did not allocate" in str(error)
    assert f"{body.__code__.co_filename}:{body.__code__.co_firstlineno}" in str(error)


def check_set_on_foreign_tensor_rejected(backend):
    x = torch.randn(16, device=backend.device)
    other = torch.randn(16, device=backend.device)
    error = capture_error(backend, lambda: x.set_(other.untyped_storage(), 0, (16,), (1,)))
    assert "aten.set_" in str(error) and "re-point" in str(error)


def check_data_assignment_rejected(backend):
    x = torch.randn(16, device=backend.device)

    def body():
        y = x * 2
        x.data = torch.zeros(16, device=x.device)  # no op dispatches: caught by the address book
        return y + x

    error = capture_error(backend, body)
    assert "changed address" in str(error) or "re-pointed" in str(error)


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
        from mhc_cg.pipeline.planner import count_static_input_buffers
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


def check_pipeline_matches_eager(backend_name: str, device: str, same=torch.equal):
    """``same(actual, expected)``: ``torch.equal`` (bit-identical) unless a backend's kernels may
    legitimately differ between eager and captured runs (cuBLAS/attention algorithm choice)."""
    torch.manual_seed(0)
    cfg = tiny_layers_config()
    layers = [MHCTransformerLayer(cfg, i).to(device) for i in range(cfg.num_layers)]
    order = rank0_interleaved_order()
    layout = order_layout(order, 2, len(layers), 2 * 4 * 2)
    width = cfg.num_streams * cfg.hidden_size
    sample_args = [(torch.randn(LAYER_SEQ, LAYER_BATCH, width, device=device, requires_grad=True),
                    torch.zeros((), dtype=torch.int64, device=device))
                   for _ in range(len(layers) * layout.num_microbatches)]
    graphed = make_graphed_callables(tuple(layers), sample_args, order=order, num_layers_per_chunk=2,
                                     backend=backend_name)
    assert len(graphed) == len(sample_args)
    assert all(g.stats.violations == 0 for g in graphed.graphs())
    assert count_allocated_static_inputs(graphed) == planner_prediction(order, [2, 2], True)
    assert count_allocated_static_inputs(graphed) < len(sample_args)

    def eager(chunk, mb, layer, x, seed):
        return layers[layout.callable_index(chunk, layer)](x, seed)

    def replayed(chunk, mb, layer, x, seed):
        return graphed[layout.sample_index(chunk, mb, layer)](x, seed)

    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second iteration replays graphs whose buffers hold the first one's data
        xs, seeds, grad_outs = [[t.to(device) for t in ts] for ts in
                                iteration_data(cfg, layout.num_microbatches, generator)]
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        ref_out, ref_in_grads = drive_pipeline(order, layout, eager, xs, seeds, grad_outs)
        ref_param_grads = layer_param_grads(layers)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        out, in_grads = drive_pipeline(order, layout, replayed, xs, seeds, grad_outs)
        param_grads = layer_param_grads(layers)
        for mb in range(layout.num_microbatches):
            assert same(out[mb], ref_out[mb]), f"output of microbatch {mb}"
            assert same(in_grads[mb], ref_in_grads[mb]), f"input grad of microbatch {mb}"
        assert param_grads.keys() == ref_param_grads.keys()
        for name, grad in ref_param_grads.items():
            assert same(param_grads[name], grad), f"grad of {name}"
    # Dropout was on: two microbatches with different seeds see different masks.
    assert not torch.equal(out[0], out[1])


class CountingScale(torch.nn.Module):
    """``x * weight``, counting its Python calls (a side effect a replay must not repeat)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x * self.weight)


def check_module_stays_module_and_python_does_not_rerun(backend_name: str, device: str):
    module = CountingScale(5).to(device)
    sample = torch.randn(3, 5, device=device, requires_grad=True)
    graphed = make_graphed_callables(module, (sample,), num_warmup_iters=2, backend=backend_name)
    assert graphed is module and isinstance(graphed, torch.nn.Module)
    calls_at_capture = module.calls
    assert calls_at_capture == 2 + 1  # warmup iterations, then the capture
    for _ in range(3):
        x = torch.randn(3, 5, device=device, requires_grad=True)
        out = module(x)
        out.backward(torch.ones_like(out))
        x_ref = x.detach().clone().requires_grad_()
        w_ref = module.weight.detach().clone().requires_grad_()
        ref = torch.tanh(x_ref * w_ref)
        ref.backward(torch.ones_like(ref))
        assert torch.equal(out, ref) and torch.equal(x.grad, x_ref.grad)
        assert torch.equal(module.weight.grad, w_ref.grad)
        module.weight.grad = None
    assert module.calls == calls_at_capture, "the module's Python ran at replay"
    module.eval()  # a mode the graph was not captured in: the eager forward runs
    module(torch.randn(3, 5, device=device))
    assert module.calls == calls_at_capture + 1
