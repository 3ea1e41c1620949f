"""Activation (gelu) recompute: the MLP's gelu output is not kept from forward to backward.

Eager: a ``CheckpointWithoutOutput`` around the gelu, freed after fc2's forward and recomputed by a
hook on fc2's output gradient. Static runtime: fc1's output in the persistent set, the gelu output
in one arena slot per block position, refilled by the block recompute (graph-captured on tape).
Every path must give gradients bit-identical to no recompute, with dropout on.
"""

from __future__ import annotations

import functools

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mhc_cg.runtime.recompute_captures import capture_recompute_graphs
from mhc_cg.runtime.arena import ALIGN_BYTES
from mhc_cg.cli import main
from mhc_cg.config import RunConfig, load_config
from mhc_cg.core.errors import ConfigError
from mhc_cg.core.storage import distinct_storage_bytes, storage_id
from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.lab.memory.measure import measure_saved_bytes
from mhc_cg.lab.references.eager import EagerModel
from mhc_cg.recompute.block_recompute import recompute_activation_eagerly
from mhc_cg.model import MHCGPT, MHCGPTConfig
from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.runtime.frame import Frame
from mhc_cg.runtime.static import build_static_recompute
from mhc_cg.lab.resolve import train_config

import helpers
from helpers import eager_run, rank_model, static_run

SEQ, MBS, FFN = 16, 2, 128
SHAPE = dict(vocab_size=32, seq_length=SEQ, hidden_size=32, num_heads=4, num_streams=4,
             hidden_dropout=0.2)
ACT_BYTES = SEQ * MBS * FFN * 4  # one gelu output, [s, b, ffn] fp32


def make_model(num_layers: int = 4, made: list | None = None, **overrides) -> MHCGPT:
    """The model, its MLPs that ask for it recomputing the gelu eagerly (each checkpoint made
    appended to ``made``), as the modes build it."""
    torch.manual_seed(0)  # the same weights whatever the recompute options
    return MHCGPT(MHCGPTConfig(**SHAPE, num_layers=num_layers, **overrides),
                  functools.partial(recompute_activation_eagerly, made=made)).train()


def eager(model: MHCGPT) -> EagerModel:
    """``model`` as the eager modes run it: block recompute as its config says."""
    return EagerModel(model)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 32, (MBS, SEQ), generator=g), torch.randint(0, 32, (MBS, SEQ), generator=g),
             torch.tensor(100 + i)) for i in range(n)]


def grads_after(model, forward, data):
    """Forward every microbatch, then backward them first-in first-out (microbatches in flight)."""
    model.zero_grad(set_to_none=True)
    losses = [F.cross_entropy(forward(ids, seed).flatten(0, 1), tgt.flatten()) for ids, tgt, seed in data]
    for loss in losses:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def mismatched(want: dict, got: dict) -> list[str]:
    return [n for n in want if not torch.equal(want[n], got[n])]


def static_forward(model, runtime):
    return lambda ids, seed: model.logits(runtime.forward(model.embed(ids), seed))


# ---------------------------------------------------------------- eager
@pytest.mark.parametrize("recompute,layers", [("none", None), ("none", 3), ("block", None), ("block", 1)])
def test_eager_gradients_bit_identical_to_no_recompute(recompute, layers):
    data = batches(2)
    plain = make_model()
    want = grads_after(plain, plain, data)
    made = []
    model = make_model(made=made, recompute=recompute, recompute_layers=2,
                       recompute_activation=True, recompute_activation_layers=layers)
    got = grads_after(model, eager(model), data)
    assert not mismatched(want, got), mismatched(want, got)
    flags = [layer.mlp.fn.recompute_activation for layer in model.layers]
    assert flags == [True] * 4 if layers is None else flags == [i < layers for i in range(4)]
    # one gelu checkpoint per microbatch and MLP that asks, each recomputed and consumed
    assert len(made) == 2 * sum(flags) and {c.state for c in made} == {"consumed"}


def test_eager_forward_frees_the_gelu_output_until_fc2_backward():
    ckpts = []
    model = make_model(made=ckpts, recompute_activation=True)
    ids, _, seed = batches(1)[0]
    out = eager(model)(ids, seed)
    assert len(ckpts) == len(model.layers)
    assert all(c.state == "discarded" for c in ckpts)
    assert all(c.outputs[0].untyped_storage().nbytes() == 0 for c in ckpts)
    out.sum().backward()
    assert all(c.state == "consumed" for c in ckpts)
    with torch.no_grad():  # no backward to come: the plain MLP, nothing checkpointed
        model(ids, seed)
    assert len(ckpts) == len(model.layers)


# ---------------------------------------------------------------- static runtime
@pytest.mark.parametrize("block_size,layers", [(1, None), (2, None), (2, 3), (4, 2)])
def test_static_runtime_with_tape_recompute_graphs_bit_identical(block_size, layers):
    data = batches(3)
    plain = make_model()
    want = grads_after(plain, plain, data)
    model = make_model(recompute_activation=True, recompute_activation_layers=layers)
    runtime = build_static_recompute(list(model.layers), block_size, seq_length=SEQ,
                                     micro_batch_size=MBS, capacity=3, device="cpu")
    runtime.recompute_graphs.update(capture_recompute_graphs(runtime, get_backend("tape")))
    got = grads_after(model, static_forward(model, runtime), data)
    assert not mismatched(want, got), mismatched(want, got)
    assert len(runtime.trace) == 3 * runtime.layout.num_blocks
    assert all(line.endswith("(graph)") for line in runtime.trace)
    assert all(graph.stats.violations == 0 for graph in runtime.recompute_graphs.values())


def test_without_the_slot_refill_the_shared_activation_slot_gives_wrong_gradients():
    """Negative control: later blocks and microbatches really overwrite the activation slot."""
    data = batches(2)
    plain = make_model()
    want = grads_after(plain, plain, data)
    model = make_model(recompute_activation=True)
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=2, device="cpu")
    runtime.recompute.activations.refill = lambda record, pset: None
    got = grads_after(model, static_forward(model, runtime), data)
    assert mismatched(want, got)


@pytest.mark.parametrize("num_layers,capacity", [(4, 1), (4, 3), (8, 2)])
def test_arena_grows_by_one_activation_slot_per_block_position(num_layers, capacity):
    block_size = 2

    def runtime(**overrides):
        model = make_model(num_layers, **overrides)
        return build_static_recompute(list(model.layers), block_size, seq_length=SEQ,
                                      micro_batch_size=MBS, capacity=capacity, device="cpu")

    base, act = runtime(), runtime(recompute_activation=True)
    # one slot per position in a block, whatever the number of layers or microbatches
    assert act.arena.nbytes - base.arena.nbytes == block_size * ACT_BYTES
    assert ACT_BYTES % ALIGN_BYTES == 0
    assert [len(act.arena.regions[f"L{p}.mlp.act"].slots) for p in range(block_size)] == [1, 1]
    # per microbatch, fc1's output of every layer moves into the set (the gelu saves that view)
    assert act.sets.nbytes_per_set - base.sets.nbytes_per_set == num_layers * ACT_BYTES
    assert act.sets.capacity == capacity


def _heap_saved_bytes(model, runtime, ids, seed) -> tuple[int, object]:
    """Bytes autograd keeps for one microbatch outside the arena, the sets and the parameters."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = runtime.forward(model.embed(ids), seed)
    static = {storage_id(p) for p in model.parameters()}
    static |= {storage_id(t) for s in runtime.sets.all_sets()
               for t in (*s.block_inputs, *s.fn_outputs.values(), *s.fc1_outputs.values())}
    return distinct_storage_bytes([t for t in saved if not runtime.arena.contains(t)], static), out


def test_a_microbatch_keeps_one_activation_less_per_layer_under_the_static_runtime():
    ids, _, seed = batches(1)[0]
    kept = {}
    for act in (False, True):
        model = make_model(recompute_activation=act)
        runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ,
                                         micro_batch_size=MBS, capacity=1, device="cpu")
        heap, out = _heap_saved_bytes(model, runtime, ids, seed)
        kept[act] = heap + runtime.sets.nbytes_per_set
        out.sum().backward()
    # autograd no longer keeps fc1's output and the gelu output (2 x ffn per token and layer);
    # the set keeps fc1's output instead: one activation less per layer and microbatch
    assert kept[False] - kept[True] == 4 * ACT_BYTES


def test_graphed_static_training_bit_identical_with_mlp_scope_on_tape():
    cfg = RunConfig()
    cfg.model = MHCGPTConfig(**SHAPE, num_layers=4, recompute_layers=2)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=MBS, num_microbatches=2, device="cpu")
    cfg.graph = dataclasses.replace(cfg.graph, backend="tape",
                                    cuda_graph_scope=["attn", "mlp", "mhc_recompute"])
    act = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, recompute_activation=True, recompute_activation_layers=3))

    def run(config, mode):
        grads = []
        result = train_config(config, steps=3, mode=mode, progress=False,
                       after_backward=lambda step, model: grads.append(
                           {n: p.grad.clone() for n, p in model.named_parameters()}))
        return result, grads

    reference, want = run(cfg, "eager_none")
    for mode in ("graphed_static", "eager_block"):
        result, got = run(act, mode)
        assert result.losses == reference.losses, mode
        for step, (w, g) in enumerate(zip(want, got)):
            assert not mismatched(w, g), (mode, step, mismatched(w, g))
    assert result.mode == "eager_block"


@pytest.mark.parametrize("block_size", [1, 2])
def test_pipeline_order_with_shared_arena_and_sets_bit_identical(monkeypatch, block_size):
    """pp=4, vpp=2, rank 0: two chunks share the arena and the set pool, many microbatches in flight."""
    from mhc_cg.core.pipeline_order import pipeline_order

    order = pipeline_order(4, 0, 8, vpp_size=2)
    ref_model, ref_grads = eager_run(order)  # no recompute at all
    plain_model = rank_model

    def act_model():
        model = plain_model()
        cfg = dataclasses.replace(model.cfg, recompute_activation=True)
        torch.manual_seed(0)
        return MHCGPT(cfg).train()

    monkeypatch.setattr(helpers, "rank_model", act_model)
    model, grads, runtimes, _ = static_run(order, block_size=block_size, graphs=True)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    ref_params = dict(ref_model.named_parameters())
    bad = [n for n, p in model.named_parameters()
           if ref_params[n].grad is not None and not torch.equal(p.grad, ref_params[n].grad)]
    assert not bad, bad
    assert all(layer.mlp.fn.recompute_activation for layer in model.layers)
    assert sorted(runtimes[1].sets.template.fc1_outputs) == [0, 1]


def test_a_graphed_mlp_with_more_than_one_persistent_set_is_refused():
    model = make_model(recompute_activation=True)
    runtime = build_static_recompute(list(model.layers), 2, seq_length=SEQ, micro_batch_size=MBS,
                                     capacity=2, device="cpu")
    x = torch.zeros(SEQ, MBS, 4 * 32, requires_grad=True)
    with pytest.raises(StaticRecomputeError, match="capacity 1"):
        runtime.path.run(runtime.layout.records[1], x,
                         Frame(runtime.sets.fixed_set(), torch.tensor(1)))


# ---------------------------------------------------------------- memory report
def test_measured_saving_is_the_gelu_output_less_one_rng_state():
    cfg = MHCGPTConfig(**SHAPE, num_layers=4, recompute_layers=2)
    r = measure_saved_bytes(cfg, MBS, device="meta")
    rng = torch.get_rng_state().nbytes  # what each gelu checkpoint holds besides fc1's output
    assert r["model"]["activation"] == ACT_BYTES
    assert r["activation"]["saved_per_layer"] == {"none": ACT_BYTES - rng, "block": ACT_BYTES - rng}


def test_memory_command_has_a_recompute_activation_row(capsys):
    assert main(["memory", "--hidden", "32", "--heads", "2", "--seq", "16", "--layers", "2",
                 "--mbs", "2"]) == 0
    table = capsys.readouterr().out
    assert "+ recompute_activation" in table and "saved by recompute_activation" in table


# ---------------------------------------------------------------- config rules
@pytest.mark.parametrize("model,message", [
    ({"recompute_activation": True, "recompute_activation_layers": 5},
     "recompute_activation_layers: 5 exceeds model.num_layers=4"),
    ({"recompute_activation": True, "recompute_activation_layers": 0}, "must be a positive integer"),
    ({"recompute_activation": True, "recompute_activation_layers": -2}, "must be a positive integer"),
    ({"recompute_activation_layers": 2}, "model.recompute_activation is false"),
    ({"recompute_activation": True, "num_experts": 4}, "every layer's MLP is MoE"),
    ({"recompute_activation": "yes"}, "model.recompute_activation: must be true or false"),
    ({"recompute_granularity": "full"}, "model.recompute_granularity: not an mhc_cg option: "
                                        "mhc_cg has no full-layer"),
    ({"recompute_method": "block"}, "no full-layer recompute, so no method"),
    ({"recompute_activation_function": True}, "is model.recompute_activation here"),
])
def test_config_rules_name_the_field(tmp_path, model, message):
    path = tmp_path / "run.yaml"
    import yaml
    path.write_text(yaml.safe_dump({"model": {"num_layers": 4, **model}}))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(path)


def test_valid_combinations_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {num_layers: 4, recompute: block, recompute_activation: true, "
                    "recompute_activation_layers: 4}\n"
                    "graph: {backend: tape, cuda_graph_scope: [attn, mlp, mhc_recompute]}\n")
    cfg = load_config(path)
    assert [cfg.model.recompute_activation_of(i) for i in range(4)] == [True] * 4
