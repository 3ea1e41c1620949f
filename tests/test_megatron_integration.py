"""megatron-core glue: config fields and spellings, YAML mapping, the mHC block on CPU, graph hook."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import CudaGraphScope  # noqa: E402

from mhc_cg.config import load_config  # noqa: E402
from mhc_cg.core.errors import ConfigError  # noqa: E402
from mhc_cg.lab.pipeline.driver import free_port  # noqa: E402
from mhc_cg.lab.planning.planner import plan  # noqa: E402
from mhc_cg.core.pipeline_order import pipeline_order  # noqa: E402
from megatron_integration.config.transformer_config import MHCTransformerConfig  # noqa: E402
from megatron_integration.capture.te_graph_helper import (RecomputeCaptureMixin, RecomputeGraphKey,  # noqa: E402
                                             recompute_capture_order)
from megatron_integration.config.field_map import to_transformer_config  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "configs"
SHAPE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
             attention_dropout=0.0, bias_dropout_fusion=False, normalization="RMSNorm",
             gradient_accumulation_fusion=False, masked_softmax_fusion=False)


def mhc_config(**fields) -> MHCTransformerConfig:
    return MHCTransformerConfig(**{**SHAPE, "enable_hyper_connections": True, **fields})


# ------------------------------------------------------------------ config
def test_dev_and_main_spellings_give_the_same_config():
    dev = mhc_config(num_residual_streams=2)
    main = MHCTransformerConfig(**SHAPE, enable_mhc_connections=True, mhc_num_residual_streams=2)
    assert (main.enable_hyper_connections, main.num_residual_streams) == (True, 2)
    assert (dev.enable_hyper_connections, dev.num_residual_streams) == (True, 2)


def test_disagreeing_spellings_are_refused():
    with pytest.raises(ValueError, match="mhc_num_residual_streams=2 .* disagrees with num_residual_streams=3"):
        mhc_config(num_residual_streams=3, mhc_num_residual_streams=2)


def test_mhc_recompute_is_kept_on_our_side_and_stripped_from_megatrons_scope():
    cfg = mhc_config(mhc_recompute_layer_num=2, mhc_dropout_impl="counter", hidden_dropout=0.1,
                     cuda_graph_scope=["attn", "mhc_recompute"])
    assert cfg.cuda_graph_scope == [CudaGraphScope.attn]
    assert cfg.mhc_recompute_graph and cfg.mhc_recompute


def test_newer_cuda_graph_modules_spelling_is_accepted():
    cfg = mhc_config(mhc_recompute_layer_num=2, hidden_dropout=0.0,
                     cuda_graph_modules=["attn", "mlp", "mhc_recompute"])
    assert cfg.cuda_graph_scope == [CudaGraphScope.attn, CudaGraphScope.mlp]
    assert cfg.mhc_recompute_graph


@pytest.mark.parametrize("fields, message", [
    (dict(enable_hyper_connections=False, mhc_recompute_layer_num=2), "enable_hyper_connections is False"),
    (dict(mhc_recompute_layer_num=None), "mhc_recompute_layer_num is None"),
    (dict(mhc_recompute_layer_num=2, hidden_dropout=0.1, mhc_dropout_impl="torch"),
     "cannot rewind"),
])
def test_graphed_recompute_needs_mhc_recompute_and_replayable_dropout(fields, message):
    with pytest.raises(ValueError, match=message):
        mhc_config(cuda_graph_scope=["attn", "mhc_recompute"], **fields)


def test_scope_of_only_mhc_recompute_under_te_is_refused():
    with pytest.raises(ValueError, match="reads as the whole layer"):
        mhc_config(mhc_recompute_layer_num=2, hidden_dropout=0.0, cuda_graph_impl="transformer_engine",
                   cuda_graph_scope=["mhc_recompute"])


# ----------------------------------------------------------------- mapping
def test_pp4_vpp2_config_maps_onto_megatron():
    cfg = to_transformer_config(load_config(CONFIGS / "gpt_mhc_pp4_vpp2.yaml"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (16, 1024, 16)
    assert (cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size) == (4, 2)
    assert cfg.params_dtype == torch.bfloat16 and cfg.bf16
    assert cfg.cuda_graph_scope == [CudaGraphScope.attn, CudaGraphScope.mlp]
    assert cfg.mhc_recompute_graph and cfg.mhc_recompute_layer_num == 2
    assert (cfg.enable_hyper_connections, cfg.num_residual_streams, cfg.mhc_dropout_impl) == (True, 4, "counter")


def test_moe_config_maps_experts_and_partial_capture_scopes():
    cfg = to_transformer_config(load_config(CONFIGS / "moe_partial_capture.yaml"))
    assert (cfg.num_moe_experts, cfg.moe_router_topk) == (4, 2)
    assert cfg.cuda_graph_scope == [CudaGraphScope.attn, CudaGraphScope.moe_router,
                                    CudaGraphScope.moe_preprocess]
    assert cfg.use_cpu_initialization


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_maps(name):
    run_cfg = load_config(CONFIGS / name)
    cfg = to_transformer_config(run_cfg)
    assert cfg.num_layers == run_cfg.model.num_layers
    assert cfg.mhc_recompute == (run_cfg.model.recompute == "block")


def test_mapping_validates_first():
    run_cfg = load_config(CONFIGS / "moe_partial_capture.yaml")
    run_cfg.model.recompute = "none"
    with pytest.raises(ConfigError, match="set model.recompute: block"):
        to_transformer_config(run_cfg)


# ------------------------------------------------------- the block on CPU
@pytest.fixture(scope="module")
def model_parallel():
    """One gloo process, tensor/pipeline sizes 1: megatron-core's parallel state on CPU."""
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        pytest.skip("another test left torch.distributed initialised")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                         rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run_block(cfg: MHCTransformerConfig, cpu_attention: bool = True, device: str = "cpu"):
    from megatron_integration.layers.mhc_layer import MHCTransformerBlock, get_mhc_layer_spec

    torch.manual_seed(0)
    if device == "cuda":
        # megatron initialises (and drops out) on CUDA through its RNG tracker, which needs its
        # own seed: without it the first fork() raises that the tracker has no such state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    block = MHCTransformerBlock(cfg, get_mhc_layer_spec(cpu_attention=cpu_attention)).to(device).train()
    torch.manual_seed(1)
    x = torch.randn(8, 2, cfg.hidden_size, device=device, requires_grad=True)
    out = block(x, attention_mask=None)
    managers = list(getattr(block, "recompute_managers", []))
    freed = sum(o.untyped_storage().nbytes() == 0 for m in managers for c in m.checkpoints for o in c.outputs)
    out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    return out.detach(), x.grad.clone(), grads, freed


@pytest.mark.parametrize("dropout_impl", ["torch", "counter"])
def test_block_gradients_with_mhc_cg_recompute_equal_without(model_parallel, dropout_impl):
    base = dict(hidden_dropout=0.1, mhc_dropout_impl=dropout_impl)
    out0, dx0, grads0, _ = run_block(mhc_config(**base))
    out1, dx1, grads1, freed = run_block(mhc_config(**base, mhc_recompute_layer_num=2))
    assert freed > 0  # the mHC intermediates were discarded between forward and backward
    assert torch.equal(out0, out1) and torch.equal(dx0, dx1)
    assert grads0.keys() == grads1.keys() and any("attention_hc" in k for k in grads0)
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name


def test_block_streams_shapes_and_mhc_off_is_megatrons_layer(model_parallel):
    out, dx, grads, _ = run_block(mhc_config(num_residual_streams=4, hidden_dropout=0.0))
    assert out.shape == (8, 2, 32) and dx.shape == (8, 2, 32)
    assert grads["layers.0.attention_hc.mapping_proj.weight"].shape == (4 * 4 + 2 * 4, 4 * 32)
    plain = MHCTransformerConfig(**SHAPE, hidden_dropout=0.0)
    out, _, grads, _ = run_block(plain)
    assert out.shape == (8, 2, 32) and not any("_hc" in k for k in grads)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_with_megatrons_dot_product_attention_on_cuda(model_parallel):
    # megatron-core 0.16's DotProductAttention.forward takes its score buffer from
    # parallel_state.get_global_memory_buffer().get_tensor(), which allocates on
    # torch.cuda.current_device(): this spec cannot run without CUDA.
    cfg = mhc_config(hidden_dropout=0.0, use_cpu_initialization=False)
    out0, dx0, _, _ = run_block(cfg, cpu_attention=False, device="cuda")
    out1, dx1, _, _ = run_block(mhc_config(hidden_dropout=0.0, use_cpu_initialization=False,
                                           mhc_recompute_layer_num=2), cpu_attention=False, device="cuda")
    assert torch.equal(out0, out1) and torch.equal(dx0, dx1)


# -------------------------------------------------------------- graph hook
def test_recompute_capture_order_covers_the_planners_graphs_per_rank():
    for rank_plan in plan(4, 2, 8, 16):
        keys = recompute_capture_order(rank_plan.order, rank_plan.layers_per_chunk,
                                       rank_plan.recompute_block_size)
        assert len(keys) == len(set(keys)) == rank_plan.recompute_graphs


def test_recompute_capture_order_follows_the_first_backwards():
    order = pipeline_order(2, 1, 4, 1)  # last rank, 1F1B: [1, -1, 1, -1, ...]
    assert order[:2] == [1, -1]
    keys = recompute_capture_order(order, 4, 2)
    # one slot set suffices; backward walks the blocks last to first
    assert keys == [RecomputeGraphKey(1, 1, 0), RecomputeGraphKey(1, 0, 0)]


def test_mixin_captures_recompute_graphs_in_order_before_megatron_finishes():
    """The helper-side mixin on a stand-in for megatron's helper (which needs TE): every chunk's
    recompute graphs, captured along the helper's order before its capture phase ends, held by
    the runtimes whose block hooks replay them (the real helper: tests/test_megatron_helper.py)."""
    from helpers import PIPELINE_MBS, PIPELINE_SEQ, chunk_layers, rank_model
    from mhc_cg.core.pipeline_order import peak_in_flight
    from mhc_cg.lab.emulation.backends import get_backend
    from mhc_cg.runtime.static import build_static_recompute

    order = pipeline_order(2, 0, 4, 2)  # rank 0 of pp 2, 2 chunks, 4 microbatches
    model, shape = rank_model(), dict(seq_length=PIPELINE_SEQ, micro_batch_size=PIPELINE_MBS,
                                      capacity=peak_in_flight(order), device="cpu")
    first = build_static_recompute(chunk_layers(model, 1), 1, **shape)
    # one arena and one pool of slot sets for the rank's chunks, as in the pipeline
    runtimes = [first, build_static_recompute(chunk_layers(model, 2), 1, arena=first.arena,
                                              sets=first.sets, **shape)]
    events = []

    class HelperWithoutTE:  # megatron's TECudaGraphHelper's two hooked methods, in its sequence
        def _get_cuda_graph_input_data(self):
            return ["sample"], {"_order": order}

        def _finish_capturing(self, start_time):
            events.append(("finish", sum(len(rt.recompute_graphs) for rt in runtimes)))

        def create_cudagraphs(self):
            self._get_cuda_graph_input_data()
            self._finish_capturing(0.0)

    class Helper(RecomputeCaptureMixin, HelperWithoutTE):
        mhc_backend = get_backend("tape")  # the CPU's: make_te_graph_helper(..., backend=)

        def mhc_decoders(self):
            return []  # no megatron decoders here: the runtimes stand alone

        def mhc_runtimes(self):
            return runtimes

    helper = Helper()
    helper.create_cudagraphs()
    keys = recompute_capture_order(order, [len(rt.layout.layers) for rt in runtimes], 1)
    assert len({key.slot_set for key in keys}) == peak_in_flight(order) > 1
    assert list(helper.mhc_recompute_graphs) == keys
    assert events == [("finish", len(keys))]  # all captured before megatron's phase ends
    for key, graph in helper.mhc_recompute_graphs.items():
        assert runtimes[key.chunk - 1].recompute_graphs[(key.block, key.slot_set)] is graph


@pytest.mark.parametrize("graphs", [False, True])
def test_block_on_static_buffers_equals_without_recompute(model_parallel, graphs):
    """megatron-core's mHC block through mhc_cg's static runtime (arena slots, persistent sets,
    tape recompute graphs), two microbatches in flight: outputs and every gradient bit-identical."""
    from mhc_cg.lab.emulation.backends import get_backend
    from megatron_integration.layers.mhc_layer import MHCTransformerBlock, get_mhc_layer_spec
    from megatron_integration.capture.static_block import StaticMHCBlock

    base = dict(hidden_dropout=0.1, mhc_dropout_impl="counter")
    out0, dx0, grads0, _ = run_block(mhc_config(**base))
    cfg = mhc_config(**base, mhc_recompute_layer_num=1)
    torch.manual_seed(0)
    block = MHCTransformerBlock(cfg, get_mhc_layer_spec(cpu_attention=True)).train()
    static = StaticMHCBlock(block, seq_length=8, micro_batch_size=2, capacity=2)
    if graphs:
        static.capture_recompute_graphs(get_backend("tape"))
    torch.manual_seed(1)
    x = torch.randn(8, 2, cfg.hidden_size, requires_grad=True)
    seed = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64)  # as the block draws it
    out = static(x, dropout_seed=seed)
    other = static(torch.randn(8, 2, cfg.hidden_size), dropout_seed=seed + 1)  # in flight too
    assert torch.equal(out.detach(), out0)
    out.square().sum().backward()
    assert torch.equal(x.grad, dx0)
    for name, p in block.named_parameters():
        assert torch.equal(p.grad, grads0[name]), name
    other.sum().backward()  # the second microbatch's recompute still finds its own set
    assert static.runtime.sets.in_use == 0
    trace = static.runtime.trace
    assert len(trace) == 2 * static.runtime.layout.num_blocks
    assert all(line.endswith("(graph)" if graphs else "(eager)") for line in trace)
