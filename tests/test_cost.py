"""The cost model: kernels, bytes and capture-pool memory of recorded graphs (mhc_cg.lab.cost)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from mhc_cg.config import RunConfig
from mhc_cg.lab.cost.allocator import BLOCK_BYTES, rounded
from mhc_cg.lab.cost.cost_backend import CostBackend
from mhc_cg.lab.cost.ops import launches_kernel
from mhc_cg.lab.cost.op_counters import StepRecorder
from mhc_cg.lab.cost.report import cost_mode, cost_report, format_report, mode_configs
from mhc_cg.lab.resolve import resolve
from mhc_cg.core.errors import GraphCaptureError
from mhc_cg.graphs.guard import CaptureGuardMode
from mhc_cg.lab.emulation.tape import TapeBackend
from mhc_cg.model import MHCGPTConfig
from helpers import build_for_mode

aten = torch.ops.aten


def tiny_config(scopes=("attn", "mlp", "mhc_recompute"), num_experts=None) -> RunConfig:
    cfg = RunConfig()
    cfg.model = MHCGPTConfig(vocab_size=32, seq_length=8, hidden_size=16, num_heads=2,
                             num_layers=2, hidden_dropout=0.1, recompute="block",
                             recompute_layers=1, num_experts=num_experts, moe_top_k=2,
                             moe_ffn_hidden_size=24)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=2, num_microbatches=1,
                                    device="cpu")
    cfg.graph = dataclasses.replace(cfg.graph, backend="tape", cuda_graph_scope=list(scopes))
    return cfg


# -- which ops launch kernels --------------------------------------------------------------------

def test_views_and_metadata_ops_are_free_and_compute_ops_are_kernels():
    for free in (aten.view.default, aten.transpose.int, aten.expand.default, aten.detach.default,
                 aten.t.default, aten.empty.memory_format, aten.transpose_.default,
                 aten._unsafe_view.default, aten.set_.source_Storage):
        assert not launches_kernel(free), free
    for kernel in (aten.mm.default, aten.add.Tensor, aten.add_.Tensor, aten.copy_.default,
                   aten.zeros_like.default, aten._to_copy.default, aten.gelu.default):
        assert launches_kernel(kernel), kernel


def test_kernel_count_of_a_small_module_equals_the_tape_and_a_hand_count():
    """Three counts of one forward + backward: the cost model's; the tape's (which ops a replay
    must re-run: its own classification, written independently); and the ops listed by hand."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)

    def body():
        loss = module(x).transpose(0, 1).sum()
        return torch.autograd.grad(loss, [x, *module.parameters()])

    with StepRecorder() as step:
        body()
    graph = TapeBackend().new_graph()
    with graph.capture():
        body()
    assert step.kernels == graph.stats.ops_replayed
    forward = ["addmm", "gelu", "addmm", "sum"]
    # sum's backward expands a filled scalar (ones_like); each Linear's backward: mm for the
    # input grad, mm for the weight grad, sum for the bias grad; gelu's backward one kernel
    backward = ["ones_like", "mm", "mm", "sum", "gelu_backward", "mm", "mm", "sum"]
    names = sorted(name.split(".")[-1] for name, n in step.eager.by_op.items() for _ in range(n))
    assert names == sorted(forward + backward), names
    assert step.kernels == len(forward) + len(backward)


def test_multi_tensor_ops_launch_as_cuda_chunks_their_lists():
    """CUDA's multi_tensor_apply: a block per 65536 elements, a launch per 320 blocks or per
    36 tensors of a 4-list op (fused AdamW: params, grads, exp_avgs, exp_avg_sqs; the step
    counts are not chunked); a foreach norm adds its cleanup kernel."""
    from mhc_cg.lab.cost.ops import kernel_launches, multi_tensor_launches

    assert multi_tensor_launches([320 * 65536], depth=4) == 1
    assert multi_tensor_launches([320 * 65536 + 1], depth=4) == 2
    assert multi_tensor_launches([10] * 36, depth=4) == 1
    assert multi_tensor_launches([10] * 37, depth=4) == 2
    assert multi_tensor_launches([10] * 110, depth=1) == 1
    params = [torch.empty(n, device="meta") for n in (3 * 320 * 65536, 10, 20)]
    steps = [torch.empty((), device="meta") for _ in params]
    args = (params, params, params, params, [], steps)
    assert kernel_launches(aten._fused_adamw_.default, args, {}) == 4
    assert kernel_launches(aten._foreach_norm.Scalar, (params,), {}) == 4 + 1
    assert kernel_launches(aten._foreach_add_.Scalar, (steps, 1), {}) == 1
    assert kernel_launches(aten.add.Tensor, (params[0], params[0]), {}) == 1


def test_the_bench_models_optimizer_step_launches_few_kernels_and_allocates_no_temporary():
    """The training's optimizer at the bench shape (541 M parameters, bf16): at most 64 launches
    (one norm, per 256 MiB bucket a cast and fused AdamW, the copy back, the zeroing), no
    temporary of 1 MiB, and the model state is 16 B per parameter plus one staging bucket."""
    from mhc_cg.config import load_config
    from helpers import REPO

    configs = dict(mode_configs(load_config(REPO / "configs" / "bench_h100.yaml"), "meta")[0])
    cost = cost_mode(configs["eager_none"])
    assert cost["kernels_by_phase"]["optimizer"] <= 64, cost["kernels_by_phase"]
    assert cost["step_temporaries_by_phase"].get("optimizer", 0) < 2 ** 20
    params = 541_247_920
    assert cost["peak_memory"]["model_state"] == pytest.approx(16 * params + (256 << 20),
                                                               rel=1e-4)


def test_bytes_count_inputs_and_outputs_and_expanded_inputs_once():
    a = torch.randn(64, 32)
    b = torch.randn(32).expand(64, 32)
    with StepRecorder() as step:
        a + b
    assert step.eager.bytes_read == (64 * 32 + 32) * 4
    assert step.eager.bytes_written == 64 * 32 * 4


def test_a_copy_reads_its_source_and_writes_its_destination_and_an_add_reads_both():
    dst, src = torch.empty(64, 32), torch.randn(64, 32)
    with StepRecorder() as step:
        dst.copy_(src)
    assert (step.eager.bytes_read, step.eager.bytes_written) == (64 * 32 * 4, 64 * 32 * 4)
    with StepRecorder() as step:
        dst.add_(src)
    assert (step.eager.bytes_read, step.eager.bytes_written) == (2 * 64 * 32 * 4, 64 * 32 * 4)


def test_fused_ops_are_charged_their_second_passes_and_the_buffers_they_write():
    """The pre launches three kernels: its state's two stages (the first hands the second fp32
    rows of sums per split of the features: its scratch) and its F-input pass, each stage-one and
    F-input pass reading x; its backward two, reading x and g_out in both, handing each other
    the per-token coefficients and summing the weight's per-group partials (its scratch), and
    writes x's grad over g_post (read first)."""
    from mhc_cg.ops.kernels.tiling import state_rows, state_scratch

    t, n, c = 64, 4, 32
    m = n * n + 2 * n
    x, weight, bias = torch.randn(t, n * c), torch.randn(m, n * c), torch.randn(m)
    alphas = [torch.ones(1) for _ in range(3)]
    norm = torch.ones(c)
    with StepRecorder() as step:
        fn_input, state = torch.ops.mhc_cg.pre(x, weight, *alphas, bias, norm, n, 20, 1e-5, False)
    size = lambda *ts: sum(u.numel() * u.element_size() for u in ts)  # noqa: E731
    assert step.eager.kernels == 3
    (splits, tokens, width), = state_scratch(t, c, n, m, state_rows(4, 4)).values()
    rows = 4 * splits * tokens * width  # written by the first stage, read by the second
    assert step.eager.bytes_read == size(x, x, weight, *alphas, bias, norm) + rows
    assert step.eager.bytes_written == size(fn_input, state) + rows

    g_out, g_state, g_post = torch.randn(t, c), torch.randn_like(state), torch.randn(t, n * c)
    with StepRecorder() as step:
        grads = torch.ops.mhc_cg.pre_backward_into(g_out, g_state, g_post, x, weight, *alphas,
                                                   bias, norm, state, n, 20, 1e-5, False)
    assert step.eager.kernels == 2
    groups = 1  # 64 tokens: one group keeps the partials under an eighth of x
    # fp32: g_proj, the shares, the coefficients (no previous post here: no H_post / 2 of one)
    per_token = m + (m + 3) + (3 + n + n * n)
    scratch = 4 * (t * per_token + groups * m * n * c)
    assert step.eager.bytes_read == size(g_out, g_out, g_state, g_post, x, x, weight, *alphas,
                                         bias, norm, state) + scratch
    assert step.eager.bytes_written == size(g_post, *grads) + scratch


# -- the guard pins nothing ----------------------------------------------------------------------

@pytest.mark.parametrize("keep", [False, True])
def test_guard_holds_no_tensor_unless_asked(keep):
    x = torch.randn(1024)
    refs = []
    with CaptureGuardMode("probe", keep_tensors=keep):
        tmp = x * 2
        refs.append(StorageWeakRef(tmp.untyped_storage()))
        y = tmp + 1
        del tmp
        freed_inside = refs[0].expired()
    del y
    assert freed_inside is not keep  # without keep_tensors the temporary is freed mid-capture


# -- the allocator emulation ---------------------------------------------------------------------

def test_a_capture_that_keeps_a_temporary_alive_is_caught():
    x = torch.randn(256, 256)
    nbytes = rounded(x.untyped_storage().nbytes())
    backend = CostBackend("cpu")
    kept = []

    def body(keep: bool) -> torch.Tensor:
        tmp = x * 2            # a temporary of one block
        out = (tmp + 1).sum()  # its last use
        if keep:
            kept.append(tmp)   # the bug: held past the capture
        return out

    clean = backend.new_graph(backend.new_pool())
    with clean.capture():
        clean_out = body(False)
    leaky = backend.new_graph(backend.new_pool())
    with leaky.capture():
        leaky_out = body(True)  # held, like clean_out: both outputs escape
    assert leaky_out.shape == clean_out.shape
    assert clean.peak.escaped_bytes == rounded(clean_out.untyped_storage().nbytes())
    assert leaky.peak.escaped_bytes == clean.peak.escaped_bytes + nbytes
    # clean: tmp returns to the pool after its last use, before the sum allocates; the leak
    # keeps it, so the sum's block comes on top of it
    assert clean.peak.peak_bytes == 2 * nbytes
    assert leaky.peak.peak_bytes == 2 * nbytes + rounded(4)
    # in a pool of independent graphs the same leak is refused at capture
    independent = backend.new_pool(independent=True)
    with pytest.raises(GraphCaptureError, match="still alive after it"):
        graph = backend.new_graph(independent)
        with graph.capture():
            body(True)
    ok = backend.new_graph(independent)
    with ok.capture():
        body(False)


def _independent_capture() -> tuple[torch.Tensor, int, object]:
    """An input of 128 x 128 floats, its block's bytes, and a fresh graph of its own pool."""
    x = torch.randn(128, 128)
    backend = CostBackend("cpu")
    return x, rounded(x.untyped_storage().nbytes()), backend.new_graph(
        backend.new_pool(independent=True))


def test_held_peak_sees_memory_python_keeps_past_its_last_use():
    x, block, graph = _independent_capture()
    with graph.capture():
        a = x * 2
        b = a + 1      # last use of a
        c = b * 3      # last use of b
        d = c + 1      # last use of c; a, b, c still referenced by Python
        del a, b, c, d
    assert graph.peak.peak_bytes == 2 * block   # by last use, two blocks at a time
    assert graph.peak.held_peak_bytes == 4 * block
    assert graph.peak.escaped_bytes == 0


def test_a_storage_freed_in_place_during_a_capture_is_reused_there():
    """Eager block recompute inside one capture: an output discarded (``resize_(0)``) frees its
    block for what comes next, and allocated again it is a new block of the pool."""
    x, block, graph = _independent_capture()
    with graph.capture():
        a = x * 2
        a.untyped_storage().resize_(0)   # discarded
        b = x * 3                        # takes a's block
        a.untyped_storage().resize_(x.untyped_storage().nbytes())  # recomputed into
        a.copy_(b)
        out = (a + b).sum()
        del a, b, out
    assert graph.stats.violations == 0
    assert graph.peak.allocated_bytes >= 4 * block  # a, b, a again, a + b
    # never a's first block with the rest: a, b and a + b at most, and the sum's scalar
    assert graph.peak.held_peak_bytes == 3 * block + BLOCK_BYTES


def test_a_shared_pool_reuses_blocks_freed_by_earlier_captures():
    x = torch.randn(64, 64, requires_grad=True)
    block = rounded(x.untyped_storage().nbytes())
    backend = CostBackend("cpu")
    pool = backend.new_pool()
    fwd, bwd = backend.new_graph(pool), backend.new_graph(pool)
    with fwd.capture():
        y = (x * 2).tanh()   # tanh saves its output: one block escapes with y
        loss = y.sum()
    with bwd.capture():
        (grad,) = torch.autograd.grad(loss, [x])
    del y, loss
    assert fwd.peak.escaped_bytes >= block
    assert bwd.peak.resident_before == fwd.peak.escaped_bytes
    # the pool's high-water mark is the larger of the two captures, not their sum
    assert pool.state.high_water == max(fwd.peak.held_peak_bytes, bwd.peak.held_peak_bytes)
    assert pool.state.high_water < fwd.peak.allocated_bytes + bwd.peak.allocated_bytes


# -- the runtime under the cost model ------------------------------------------------------------

def test_backward_graphs_give_their_gradients_back_to_the_pool():
    """Every replay clones a backward graph's input and weight gradients at once, so once captured
    they go back to the pool: after N layers only the forward outputs (tanh saves its output) are
    live in it, not N sets of gradients."""
    from mhc_cg.graphs.graphed_callables import GraphOptions, make_graphed_callables

    batch, width, layers = 16, 32, 4
    modules = tuple(torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.Tanh())
                    for _ in range(layers))
    samples = tuple((torch.randn(batch, width, requires_grad=True),) for _ in range(layers))
    backend = CostBackend("cpu")
    graphed = make_graphed_callables(modules, samples, options=GraphOptions(backend=backend))
    activation, weight = rounded(batch * width * 4), rounded(width * width * 4)
    backwards = [r.bwd_graph for r in graphed.states]
    assert all(g.peak.escaped_bytes == activation + weight for g in backwards)  # x and W grads
    live = sum(b.nbytes for b in graphed.pool.state.live_resident())
    assert live == layers * activation
    # each backward capture starts with the earlier ones' gradients already free
    assert all(g.peak.resident_before <= layers * activation for g in backwards)


def test_recompute_graphs_join_the_sublayer_pool_where_they_replay():
    """With every sublayer a graph, each block's recompute graph is captured into the sublayer
    graphs' pool right before the backward of the block's last sublayer (where its hook replays
    it), and leaves nothing allocated; the tape's order check then holds over a training step.
    The last block has none: each backward finds it still in the arena."""
    cfg = tiny_config()
    graphed = build_for_mode(cfg, "graphed_static", torch.device("cpu"))  # the tape
    model, forward = graphed.model, graphed
    recompute = graphed.runtime.recompute_graphs
    pool = graphed.graphed_callables.pool
    assert set(recompute) == {(0, 0)} and all(g.pool is pool for g in recompute.values())
    sequence = pool.order.sequence
    states = graphed.graphed_callables.states
    # one layer per block: block 0's mlp (sublayer 1) ends it
    assert sequence[sequence.index(recompute[(0, 0)]) + 1] is states[1].bwd_graph
    for _ in range(2):
        ids = torch.randint(0, 32, (2, 8))  # [micro_batch, seq]
        forward(ids, torch.zeros((), dtype=torch.int64)).sum().backward()
    assert [g.replays for g in recompute.values()] == [2]
    assert graphed.runtime.recomputes[(1, "kept")] == 2
    backend = CostBackend("cpu")
    from mhc_cg.training.run import build
    from mhc_cg.lab.resolve import resolve
    costed = build(resolve(cfg, "graphed_static", "cpu"), backend=backend)
    assert all(g.peak.escaped_bytes == 0 for g in costed.runtime.recompute_graphs.values())


def test_recompute_graphs_alone_share_one_independent_pool():
    """Without sublayer graphs the recompute graphs have one pool of their own, of independent
    graphs: they may replay in any order (that of the schedule's backwards)."""
    cfg = tiny_config(scopes=("mhc_recompute",))
    graphed = build_for_mode(cfg, "graphed_static", torch.device("cpu"))  # the tape
    graphs = list(graphed.runtime.recompute_graphs.values())
    assert len(graphs) == 2 and len({id(g.pool) for g in graphs}) == 1
    assert graphs[0].pool.independent
    backend = CostBackend("cpu")
    from mhc_cg.training.run import build
    from mhc_cg.lab.resolve import resolve
    graphed = build(resolve(cfg, "graphed_static", "cpu"), backend=backend)
    recompute = list(graphed.runtime.recompute_graphs.values())
    assert all(g.peak.escaped_bytes == 0 for g in recompute)
    # any order: block 0 then block 1, although captured the other way round
    for key in sorted(graphed.runtime.recompute_graphs):
        graphed.runtime.recompute_graphs[key].replay()


def test_meta_and_cpu_cost_the_same_graphs_and_arena():
    """meta tells storages apart by identity (every data_ptr is 0 there): same arena, same
    recompute graphs. Attention's forward decomposes differently on meta (the fused attention a GPU
    runs), and nothing else in the graphs; the eager ops within 1%."""
    cfg = tiny_config()
    cpu, meta = (cost_mode(resolve(cfg, "graphed_static", device)) for device in ("cpu", "meta"))
    assert cpu["arena_bytes"] == meta["arena_bytes"] > 0
    assert cpu["persistent_bytes_per_microbatch"] == meta["persistent_bytes_per_microbatch"] > 0
    for a, b in zip(cpu["graphs"], meta["graphs"]):
        assert a["name"] == b["name"] and a["kind"] == b["kind"]
        if a["kind"] == "recompute":
            assert a["kernels"] == b["kernels"] and a["bytes"] == b["bytes"]
            # their own need; what the shared pool held before them differs with attention
            assert (a["pool_peak_bytes"] - a["pool_resident_bytes"]
                    == b["pool_peak_bytes"] - b["pool_resident_bytes"])
            assert a["escaped_bytes"] == b["escaped_bytes"] == 0
    # graphs differ only where attention's forward runs (the fused kernel a GPU picks on meta)
    differ = [a["name"] for a, b in zip(cpu["graphs"], meta["graphs"]) if a["kernels"] != b["kernels"]]
    assert all(name.endswith("attn fwd") for name in differ), differ
    # on the CPU, the host's own work (drawing the batch and its seed) is the device's too, and
    # the batch's three copies to the device are none
    assert cpu["host_ops_per_step"] == 0 < meta["host_ops_per_step"]
    uploads = 3 * cfg.train.num_microbatches
    assert cpu["eager_kernels_per_step"] == \
        meta["eager_kernels_per_step"] - uploads + meta["host_ops_per_step"]
    kinds = [g["kind"] for g in meta["graphs"]]
    assert kinds.count("forward") == kinds.count("backward") == 4 and kinds.count("recompute") == 1
    # a step's kernels: its eager ops plus every replay's kernels (each graph replays once)
    replayed = sum(g["kernels"] for g in meta["graphs"])
    assert meta["graph_replays_per_step"] == len(meta["graphs"])
    assert meta["kernels_per_step"] == meta["eager_kernels_per_step"] + replayed


def test_report_lists_every_mode_with_the_documented_fields():
    report = cost_report(tiny_config(), "meta", "tiny")
    assert list(report["modes"]) == ["eager_none", "eager_block", "graphed_none", "graphed_static",
                                     "attn_split", "graphed_full", "graphed_full_static",
                                     "plain_residual"]
    assert list(report["skipped"]) == ["moe_partial"]  # MoE dispatch reads token counts on the host
    # the paper's headline: each mode's step over the same F's on a plain residual
    plain = report["modes"]["plain_residual"]
    assert plain["mhc_overhead"] == {"low": 0, "high": 0} and plain["mhc_traffic_C"]["total"] == 0
    for m in report["modes"].values():  # end by end: the same assumption over both steps
        for end in ("low", "high"):
            assert m["mhc_overhead"][end] == pytest.approx(
                m["step_s"][end] / plain["step_s"][end] - 1)
        assert 0 < m["bandwidth_bound_s"]["low"] <= m["step_s"]["low"] <= m["step_s"]["high"]
    for mode, m in report["modes"].items():
        for key in ("kernels_per_step", "bytes_per_step", "graphs", "pool_reserved_bytes",
                    "arena_bytes", "persistent_bytes_per_microbatch"):
            assert key in m, (mode, key)
        assert m["kernels_per_step"] > 0 and m["bytes_per_step"] > 0
    assert report["modes"]["eager_none"]["graphs"] == []
    assert report["modes"]["graphed_none"]["arena_bytes"] is None
    assert len(report["checks"]) == 3
    # the second budget counts what both modes keep outside their pools too
    static, none = report["modes"]["graphed_static"], report["modes"]["graphed_none"]
    kept = (static["pool_reserved_bytes"] + static["arena_bytes"] + static["static_buffer_bytes"]
            + static["persistent_bytes_per_microbatch"])
    assert report["checks"][1]["value"] == kept / (none["pool_reserved_bytes"]
                                                   + none["static_buffer_bytes"])
    # the third: the mode this project exists for keeps no more than eager block recompute
    block = report["modes"]["eager_block"]
    assert report["checks"][2]["value"] == static["peak_bytes"] / block["peak_bytes"]
    assert report["checks"][2]["ok"] == (static["peak_bytes"] <= block["peak_bytes"])


def test_static_buffers_outside_the_pools_are_counted_once_per_storage():
    """graphed_none reads each sublayer's input from a buffer of its own; graphed_static's graphs
    read theirs where the static runtime keeps them (persistent set, arena), which adds nothing;
    both share one grad-output buffer (n*C per token each). The dropout seeds are int64 scalars."""
    report = cost_report(tiny_config(), "meta", "tiny")
    cfg = tiny_config().model
    stream = 8 * 2 * cfg.num_streams * cfg.hidden_size * 4  # [seq, mbs, n*C] fp32
    graphs = 2 * cfg.num_layers
    assert report["modes"]["eager_none"]["static_buffer_bytes"] is None
    none = report["modes"]["graphed_none"]["static_buffer_bytes"]
    static = report["modes"]["graphed_static"]["static_buffer_bytes"]
    assert (graphs + 1) * stream <= none <= (graphs + 1) * stream + 8 * graphs
    assert stream <= static <= stream + 8 * graphs


def test_moe_config_costs_partial_capture_on_cpu_and_is_refused_on_meta():
    from mhc_cg.core.errors import ConfigError
    cfg = tiny_config(("attn", "moe_router", "moe_preprocess", "mhc_recompute"), num_experts=2)
    with pytest.raises(ConfigError, match="--device cpu"):
        cost_report(cfg, "meta")
    costed, skipped = mode_configs(cfg, "cpu")
    modes = dict(costed)
    assert list(modes) == ["eager_none", "eager_block", "graphed_none", "graphed_static",
                           "attn_split", "moe_partial", "plain_residual"]
    # a dropless MoE dispatch reads its token counts on the host: no captured iteration
    assert set(skipped) == {"graphed_full", "graphed_full_static"}
    assert all(why.startswith("model.num_experts: a dropless MoE layer") for why in skipped.values())
    partial = cost_mode(modes["moe_partial"])
    heads = [g for g in partial["graphs"] if g["name"].endswith(".head fwd")]
    assert len(heads) == 2  # the MoE sublayer's captured head, one per layer
    assert partial["eager_kernels_per_step"] > 0  # the eager tail (dispatch, experts) counts


# -- where the bytes go ----------------------------------------------------------------------------

def test_every_byte_of_a_step_is_attributed_to_a_phase_and_a_part():
    report = cost_report(tiny_config(), "meta", "tiny")
    for mode, m in report["modes"].items():
        attributed = sum(b for phase in m["bytes_by_phase_and_part"].values() for b in phase.values())
        assert attributed == m["bytes_per_step"], mode
        assert set(m["bytes_by_phase_and_part"]) <= {"forward", "recompute", "backward", "optimizer"}
    copies = {mode: m["copy_bytes_per_step"] for mode, m in report["modes"].items()}
    assert copies["eager_none"] == {} and set(copies["eager_block"]) == {"refills"}
    assert set(copies["graphed_none"]) == {"static inputs"}
    assert report["modes"]["eager_none"]["mhc_traffic_C"]["recompute"] == 0
    assert report["modes"]["eager_block"]["mhc_traffic_C"]["recompute"] > 0


def test_graphs_add_no_backward_work_and_copy_no_grad():
    """A graphed mode's backward does its eager twin's F work and no more (no zeros made for the
    outputs no grad reaches) and copies no grad: weight grads stay where the graphs write them,
    the chunk input's grad goes uncloned to the expand that reads it, and the contraction writes
    the chunk output's grad where the last backward graph reads it. The twins: the modes that
    keep the pre and post in one autograd graph fuse their backward boundaries (the post's
    parameter grads summed in the pre's kernel, no adds); a checkpointed pre cannot, so
    attn_split does eager_block's work."""
    cfg = tiny_config()
    report = cost_report(cfg, "meta", "tiny")
    modes = report["modes"]
    f_work = {mode: m["bytes_by_phase_and_part"]["backward"]["F and the rest"]
              for mode, m in modes.items()}
    twins = {"graphed_none": "eager_none", "graphed_static": "eager_none",
             "attn_split": "eager_block"}
    assert all(f_work[m] == f_work[e] for m, e in twins.items()), f_work
    assert f_work["eager_none"] < f_work["eager_block"], f_work
    for mode in ("graphed_none", "graphed_static"):
        copies = modes[mode]["copy_bytes_per_step"]
        assert "grad clones" not in copies and "grad outputs" not in copies, (mode, copies)


def test_an_mlp_as_wide_as_the_streams_is_not_mhc_traffic():
    """mHC traffic is found by identity: with ffn = n * C the MLP's tensors are as wide as the
    streams, and its bytes must still count as F's."""
    def mhc_bytes(ffn):
        cfg = tiny_config()
        cfg.model = dataclasses.replace(cfg.model, ffn_hidden_size=ffn)
        m = cost_report(cfg, "meta")["modes"]["eager_none"]
        return m["mhc_traffic_C"], m["bytes_by_phase_and_part"]
    streams = 4 * 16
    as_wide, other = mhc_bytes(streams), mhc_bytes(streams - 16)
    assert as_wide[0] == other[0]  # the same mHC traffic whatever F's width
    assert as_wide[1]["forward"]["F and the rest"] > other[1]["forward"]["F and the rest"]


def test_a_recompute_graph_is_costed_beside_its_bound():
    report = cost_report(tiny_config(), "meta", "tiny")
    recompute = [g for g in report["modes"]["graphed_static"]["graphs"] if g["kind"] == "recompute"]
    assert recompute and all(g["bound_bytes"] > 0 for g in recompute)
    # the bound: block input once, then per sublayer F's output read, the stream and F's input
    # written: (n C + 2 L (n + 2) C) per token, L = 1 layer per block here, fp32
    assert recompute[0]["bound_bytes"] == 8 * 2 * (4 * 16 + 2 * 1 * 6 * 16) * 4
    assert all(g["over_bound"] == g["bytes"] / g["bound_bytes"] for g in recompute)


def test_graphed_static_copies_only_the_seed_into_its_persistent_set():
    """The expand writes the chunk's input into the set (x_l0 of block 0), F's last Linear writes
    F's output there and each sublayer graph writes its output where the next reads it: the one
    copy into the set is the dropout seed (int64), and no graph's input or grad is copied."""
    copies = cost_mode(resolve(tiny_config(), "graphed_static", "meta"))["copy_bytes_per_step"]
    assert copies == {"persistent set": 2 * 8}, copies


# -- peak memory per step ------------------------------------------------------------------------

def test_live_bytes_follow_allocations_frees_and_discarded_storages():
    """The step's eager allocations as the caching allocator holds them: from the op that makes a
    storage until Python drops it, shrunk when a checkpoint discards it (``resize_(0)``) and
    grown back when it is refilled; in-place results and views allocate nothing."""
    with StepRecorder() as recorder:
        a = torch.empty(1000, device="meta")          # 4000 B -> 4096 in blocks
        b = a * 2                                     # another 4096
        b.add_(1)                                     # in place: nothing new
        view = b[:10]                                 # a view: nothing new
        assert recorder.live.bytes == 2 * rounded(4000)
        del a
        c = b + 1                                     # a's block went back before this op
        assert recorder.live.bytes == 2 * rounded(4000)
        b.untyped_storage().resize_(0)                # discarded, as a checkpointed output
        d = c.sum()
        assert recorder.live.bytes == rounded(4000) + rounded(4)
        b.untyped_storage().resize_(4000)             # refilled by its recompute
        e = c.sum()
    assert recorder.live.peak == 2 * rounded(4000) + 2 * rounded(4)
    del view, c, d, e


def test_peak_memory_adds_up_and_block_recompute_lowers_the_step_peak():
    """Every mode's peak is the sum of what holds it; eager block recompute frees the mHC
    intermediates (lower step peak than eager without recompute); graphed modes hold graph
    pools, graphed_static also its arena and persistent set. Hidden 256 over seq 64: the mHC
    intermediates outweigh attention's scores, as at the benchmark shape (tiny widths are all
    parameters, gradients and 512-byte blocks)."""
    from mhc_cg.config import load_config

    cfg = load_config(None).replace(model={"seq_length": 64, "hidden_size": 256,
                                           "recompute_layers": 1})
    modes = cost_report(cfg, "meta", "default")["modes"]
    for name, m in modes.items():
        parts = m["peak_memory"]
        assert set(parts) == {"model_state", "static", "graph_pools", "step"}, name
        assert m["peak_bytes"] == sum(parts.values()) and parts["model_state"] > 0, name
        # the peak is reached in one phase, over what every phase holds for the whole step
        phases = m["peak_bytes_by_phase"]
        held = m["peak_bytes"] - parts["step"]
        assert {"forward", "backward", "optimizer"} <= set(phases), name
        assert m["peak_bytes"] == phases[m["peak_phase"]] == max(phases.values()), name
        # a phase with eager work allocates over what the step holds; one run inside graphs only
        # (a captured iteration's backward, graphed_static's recompute) holds just that
        assert all(held <= b <= m["peak_bytes"] for b in phases.values()), name
        if not m["graphs"]:
            assert held < min(phases.values()), name
    assert "recompute" in modes["eager_block"]["peak_bytes_by_phase"]
    none, block = modes["eager_none"]["peak_memory"], modes["eager_block"]["peak_memory"]
    assert none["model_state"] == block["model_state"] and none["graph_pools"] == 0
    assert block["step"] < none["step"]
    static = modes["graphed_static"]
    assert static["peak_memory"]["graph_pools"] == static["pool_reserved_bytes"] > 0
    assert static["peak_memory"]["static"] >= (static["arena_bytes"]
                                               + static["persistent_bytes_per_microbatch"])
    # what is live at the peak (mhc-cg cost --live) itemizes those very sums
    for name, m in modes.items():
        live, parts = m["live_at_peak"], m["peak_memory"]
        assert live["model_state"] == parts["model_state"], name
        assert sum(live["static"].values()) == parts["static"], name
        assert sum(p["high_water"] for p in live["pools"]) == parts["graph_pools"], name
        assert sum(n for _, n in live["eager"]) == parts["step"], name
        labels = {g["name"] for g in m["graphs"]}
        for pool in live["pools"]:  # a mark set by a named capture, made of what it held then
            assert pool["set_by"] in labels and 0 < sum(n for _, n in pool["live"]) \
                <= pool["high_water"], (name, pool["set_by"])
    pool = max(modes["graphed_static"]["live_at_peak"]["pools"], key=lambda p: p["high_water"])
    assert pool["set_by"].endswith("bwd")  # the saved activations and a backward's temporaries


def _held_storages(root) -> dict[int, int]:
    """Every tensor storage reachable from ``root`` through Python references (not through code:
    a function's globals or a module lead everywhere): storage -> its bytes in 512-byte blocks."""
    import gc
    import types

    from mhc_cg.core.storage import storage_id

    held, seen, todo = {}, set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.FunctionType, types.ModuleType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            held[storage_id(obj)] = rounded(obj.untyped_storage().nbytes())
            if obj.grad is not None:
                todo.append(obj.grad)
            continue
        todo.extend(gc.get_referents(obj))
    return held


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_model_state_is_what_a_training_session_holds(dtype):
    """The cost model's model state is the bytes a CPU training session really holds between
    steps (everything reachable from it: model, optimizer, data), for the same model."""
    from mhc_cg.lab.resolve import resolve
    from mhc_cg.training.session import TrainSession

    cfg = tiny_config().replace(train={"dtype": dtype})
    session = TrainSession.build(resolve(cfg, "eager_none", "cpu"))
    session.step()
    held = sum(_held_storages(session).values())
    cost = cost_mode(dict(mode_configs(cfg, "cpu")[0])["eager_none"])
    assert cost["peak_memory"]["model_state"] == held
    params = sum(p.numel() for p in session.model.parameters())
    per_param = {"bf16": 2 + 2 + 4 + 8, "fp32": 4 + 4 + 8}[dtype]  # model, grad, main, moments
    assert held >= per_param * params


def test_cost_draws_the_frontier(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    png = tmp_path / "frontier.png"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "mhc_cg", "cost", "--summary", "--plot", str(png)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory and time per step" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "mhc_cg", "cost", "--plot", str(tmp_path / "f.jpg")],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (f"mhc-cg cost: error: --plot: {tmp_path / 'f.jpg'} is not a .png; "
                                  f"give a path ending in .png")


def test_the_loss_holds_no_fp32_copy_of_the_logits():
    """The step's eager peak over the loss, forward and backward, as the cost model records it:
    ``lm_loss`` holds the logits' gradient in their dtype and per-row values, while
    ``F.cross_entropy`` on upcast logits holds fp32 copies of all of them (the benchmark's peak,
    1.5 GiB at 4096 tokens and a 32000 vocabulary). The bytes: the logits read once forward and
    once backward, the gradient written once."""
    from mhc_cg.model import lm_loss

    t, v = 64, 1000
    targets = torch.randint(0, v, (t,))

    def record(loss_of):
        logits = torch.randn(t, v, dtype=torch.bfloat16).requires_grad_()
        recorder = StepRecorder()
        with recorder:
            loss_of(logits).backward()
        return recorder

    ours = record(lambda logits: lm_loss(logits, targets, "torch"))
    theirs = record(lambda logits: torch.nn.functional.cross_entropy(logits.float(), targets))
    logits_bytes = t * v * 2
    assert ours.live.peak < logits_bytes * 1.1 < 4 * logits_bytes < theirs.live.peak
    assert ours.bytes < 3.2 * logits_bytes < 10 * logits_bytes < theirs.bytes


def test_the_losss_and_the_final_norms_ops_are_no_mhc_traffic():
    """Every registered op of the loss and of the model's final norm (their in-place variants
    too) is left out of the mHC traffic."""
    from mhc_cg.lab.cost import fused as fused_ops

    names = [n for n in dir(torch.ops.mhc_cg) if n.startswith(("cross_entropy", "rms_norm"))]
    assert len(names) >= 5
    assert {f"mhc_cg::{n}" for n in names} <= fused_ops.NOT_MHC


def test_the_loss_gradient_written_over_the_logits_holds_one_logits_tensor():
    """``grad_over_logits``: the backward writes the gradient where the (transposed) logits
    lie, so the loss's backward holds one ``[T, V]`` tensor instead of two, and the head gets
    the same gradient bit for bit; a leaf's logits are refused (its ``.grad`` would be itself)."""
    from mhc_cg.model import lm_loss

    s, b, v, c = 16, 4, 1000, 32
    targets = torch.randint(0, v, (b, s))
    hidden = torch.randn(s, b, c, dtype=torch.bfloat16)
    head = torch.randn(v, c, dtype=torch.bfloat16)

    def run(over):
        w = head.clone().requires_grad_()
        recorder = StepRecorder()
        with recorder:
            logits = torch.nn.functional.linear(hidden, w).transpose(0, 1)
            lm_loss(logits, targets, "torch", grad_over_logits=over).backward()
        return recorder, w.grad

    (plain, g_plain), (over, g_over) = run(False), run(True)
    logits_bytes = s * b * v * 2
    assert plain.live.peak - over.live.peak == logits_bytes
    assert torch.equal(g_plain, g_over)
    leaf = torch.randn(b, s, v).requires_grad_()
    with pytest.raises(ValueError, match="grad_over_logits"):
        lm_loss(leaf, targets, "torch", grad_over_logits=True)


def test_the_loss_reads_the_models_transposed_logits_without_a_copy():
    """The model's logits ``[b, s, V]`` are a transposed view of ``[s, b, V]``: the loss takes
    the rows in memory order (targets permuted alike), so it moves the same bytes as on
    contiguous logits, and its value and gradient are still the cross entropy's."""
    from mhc_cg.model import lm_loss

    s, b, v = 16, 4, 1000
    targets = torch.randint(0, v, (b, s))

    def record(logits):
        recorder = StepRecorder()
        with recorder:
            loss = lm_loss(logits, targets, "torch")
            loss.backward()
        return recorder, loss

    base = torch.randn(s, b, v, dtype=torch.float32)
    leaf_t = base.clone().requires_grad_()
    leaf_c = base.transpose(0, 1).contiguous().requires_grad_()
    (transposed, loss_t), (contiguous, loss_c) = record(leaf_t.transpose(0, 1)), record(leaf_c)
    assert transposed.bytes <= contiguous.bytes + 4 * b * s * 8  # only the targets move
    want = torch.nn.functional.cross_entropy(leaf_c.detach().flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss_t, want)
    torch.testing.assert_close(leaf_t.grad.transpose(0, 1), leaf_c.grad)


def test_the_cost_model_predicts_the_h100_runs_eager_peaks_within_5_percent():
    """Back-test: configured with the optimizer the H100 run trained with (per-tensor fp32
    gradient copies, foreach AdamW), the model predicts that run's measured peak of each eager
    mode (in the optimizer step, where they were) within 5 %, and its resident bytes (the
    parameters' and the optimizer's alone) too."""
    from mhc_cg.lab.cost.backtest import backtest

    rows = backtest(modes=("eager_none", "eager_block"))["modes"]
    assert set(rows) == {"eager_none", "eager_block"}
    for mode, r in rows.items():
        assert r["peak_phase"] == "optimizer", mode
        assert abs(r["modelled_peak"] / r["measured_peak"] - 1) <= 0.05, (mode, r)
        assert abs(r["modelled_resident"] / r["measured_resident"] - 1) <= 0.05, (mode, r)


def test_a_kernel_measurement_counts_only_at_the_code_and_on_the_gpu_it_measured():
    """Note [the step is a band until the kernels are measured]: a fused kernel timed as eager
    calls (at any code) sets only the band's high end; one timed as device time at this kernel
    source on the modelled GPU sets one figure; on another GPU it counts for nothing. Bytes go
    at the copy bandwidth measured on the GPU modelled, else its table figure."""
    from mhc_cg.lab.cost.gpus import GPUS
    from mhc_cg.lab.cost.measured import kernel_source_sha256
    from mhc_cg.lab.cost.step_model import step_model

    h100 = "NVIDIA H100 80GB HBM3"
    rows = [{"device": h100, "code": "old", "class": "copy", "kernel": "copy_",
             "gb_per_s": 2680.0, "share_of_copy": 1.0},
            {"device": h100, "code": "old", "class": "fused mHC", "kernel": "pre",
             "op": "mhc_cg::pre", "kernel_source_sha256": "0" * 64,
             "timing": "CUDA events around eager calls (launch cost included)",
             "gb_per_s": 268.0, "share_of_copy": 0.1}]
    model = step_model("h100", rows)
    assert model.copy.value == pytest.approx(2.68e12) and "measured" in model.copy.source
    pre = model.fused["mhc_cg::pre_into"]  # its kind's probe
    assert (pre.low, pre.high) == (1.0, 0.1) and "unmeasured at this code" in pre.source
    moving, computing = model.kernel_seconds("mhc_cg::pre", 2680, 0)
    assert (moving.low, moving.high) == (pytest.approx(1e-9), pytest.approx(1e-8))
    assert computing.low == computing.high == 0
    timed = {**rows[1], "kernel_source_sha256": kernel_source_sha256(), "share_of_copy": 0.5,
             "timing": "profiler: the device time of the kernels each eager call launched"}
    one = step_model("h100", rows + [timed]).fused["mhc_cg::pre"]
    assert one.low == one.high == 0.5 and one.source.startswith("measured at this code")
    elsewhere = step_model("h200", rows + [timed])
    assert elsewhere.fused["mhc_cg::pre"].low == 1.0  # an H100's timing is not the H200's
    assert elsewhere.copy == GPUS["h200"].copy_bytes_per_s  # no H200 copy row: the table's
    full = step_model("h100", rows, full_bandwidth=True)
    assert full.copy.value == GPUS["h100"].hbm_bytes_per_s.value and not full.fused


def test_the_h200_moves_bytes_faster_by_its_copy_bandwidth():
    """``--gpu h200``: every mode's bandwidth-bound time below the H100's by their copy
    bandwidths' ratio, and its step below the H100's at both ends."""
    cfg = tiny_config()
    h100, h200 = (cost_report(cfg, "meta", "tiny", gpu=g) for g in ("h100", "h200"))
    assert (h100["gpu"]["key"], h200["gpu"]["key"]) == ("h100", "h200")
    ratio = h200["gpu"]["copy_charged"]["value"] / h100["gpu"]["copy_charged"]["value"]
    assert ratio > 1.3
    for name, m in h100["modes"].items():
        other = h200["modes"][name]
        for end in ("low", "high"):
            assert m["bandwidth_bound_s"][end] / other["bandwidth_bound_s"][end] == \
                pytest.approx(ratio, rel=0.02), (name, end)
            assert other["step_s"][end] < m["step_s"][end]


def test_cost_prints_the_last_measured_step_of_the_shape_beside_the_modelled_one(tmp_path):
    import json

    from mhc_cg.lab.cost.measured import last_measured_steps

    cfg = tiny_config()
    for date, step in (("2026-01-01", 50.0), ("2026-02-01", 40.0)):
        (tmp_path / f"{date}.json").write_text(json.dumps(
            {"device": "GPU", "device_type": "cuda", "code": date, "date": date,
             "config": cfg.to_dict(), "modes": {"eager_none": {"step_ms_median": step}}}))
    other = cfg.replace(model={"hidden_size": 32})
    (tmp_path / "other.json").write_text(json.dumps(
        {"device": "GPU", "device_type": "cuda", "date": "2027-01-01", "config": other.to_dict(),
         "modes": {"eager_none": {"step_ms_median": 1.0}}}))
    got = last_measured_steps(cfg, tmp_path)
    assert got["code"] == "2026-02-01" and got["modes"] == {"eager_none": 40.0}
    assert last_measured_steps(cfg.replace(model={"hidden_size": 64}), tmp_path) == {}
    report = cost_report(cfg, "meta", "tiny")
    assert report["gpu"]["key"] == "h100" and "measured_steps" in report
    text = format_report(report, per_graph=False)
    assert "step model: NVIDIA H100 SXM5 80GB (--gpu h100)" in text


def test_every_fused_op_has_a_kind_the_step_model_charges():
    """Every op registered under ``torch.ops.mhc_cg`` (its in-place and ``_into`` variants too)
    has a kind in ``FUSED_KINDS``: a variant left out would be charged the plain copy bandwidth
    without a word."""
    import torch

    import mhc_cg.ops.kernels.custom_ops  # noqa: F401  (registers the ops)
    from mhc_cg.lab.cost.measured import FUSED_KINDS

    registered = {f"mhc_cg::{name}" for name in dir(torch.ops.mhc_cg)
                  if isinstance(getattr(torch.ops.mhc_cg, name), torch._ops.OpOverloadPacket)}
    assert len(registered) >= 18
    assert registered == set(FUSED_KINDS), registered ^ set(FUSED_KINDS)
