"""Forward-only passes and stale captures in every mode, through the tape.

* A forward not followed by its backward (evaluation under ``eval()`` + ``no_grad``, a
  ``no_grad`` forward, or a training forward whose step is skipped) leaves every mode
  bit-identical to ``eager_none`` and to a run without those passes.
* ``eval()`` reaches the graphed sublayers: no dropout, gradients of eval equal eager's.
* Anything the graphs baked in (dropout p, dtype, parameters) changing after capture is refused,
  naming the field; evaluation, which replays nothing, still runs.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_run_config, write_config
from mhc_cg.cli import main
from mhc_cg.training.data import ProgressionCorpus
from mhc_cg.core.errors import StaleCaptureError, StaticRecomputeError
from mhc_cg.lab.resolve import resolve
from mhc_cg.lab.compare.modes import compared_modes
from mhc_cg.lab.compare.watch import grad_digest
from mhc_cg.training.session import TrainSession

CPU = torch.device("cpu")


def session_for(cfg, mode) -> TrainSession:
    return TrainSession.build(resolve(cfg, mode, CPU))


def side_batch(cfg, seed=99):
    """Inputs from a generator of their own: the training data stay the same."""
    inputs, targets = ProgressionCorpus(cfg.model.vocab_size, cfg.model.seq_length,
                                        seed=seed).batch(cfg.train.micro_batch_size)
    return inputs, targets, torch.tensor(4321, dtype=torch.int64)


def run(cfg, mode, *, interleave: bool):
    """Three steps; with ``interleave``, between steps: an evaluation, a no_grad forward in
    training mode and a training forward whose backward never comes."""
    session = session_for(cfg, mode)
    inputs, targets, seed = side_batch(cfg)
    steps, evals, side = [], [], []
    for _ in range(3):
        digests = []
        loss, _ = session.step(after_backward=lambda model: digests.append(grad_digest(model)))
        steps.append((loss, digests[0]))
        if interleave:
            evals.append(session.evaluate())
            with torch.no_grad():
                side.append(session.forward(inputs, seed).clone())
            abandoned = session.forward(inputs, seed)  # a skipped step: no backward follows
            side.append(abandoned.detach().clone())
    return steps, evals, side, session


def test_forward_only_passes_between_steps_keep_every_mode_bit_identical():
    cfg = tiny_run_config()
    ref_steps, ref_evals, ref_side, _ = run(cfg, "eager_none", interleave=True)
    plain_steps, _, _, _ = run(cfg, "eager_none", interleave=False)
    assert ref_steps == plain_steps  # the side passes change nothing in training
    for mode in compared_modes()[1:]:
        steps, evals, side, session = run(cfg, mode, interleave=True)
        assert steps == ref_steps, mode  # losses and every gradient (digest), every step
        assert evals == ref_evals, mode
        assert all(torch.equal(a, b) for a, b in zip(side, ref_side)), mode
        session.release_pending()
        runtime = session.mode_model.runtime
        if runtime is not None:
            assert runtime.sets.in_use == 0 and runtime.pending == 0


@pytest.mark.parametrize("mode", ["graphed_static", "graphed_none"])
def test_evaluation_claims_no_set_and_keeps_the_replay_order(mode):
    cfg = tiny_run_config()
    session = session_for(cfg, mode)
    session.step()
    graphed = session.mode_model
    replays = [g.replays for g in graphed.graphs()]
    session.evaluate()
    with torch.no_grad():
        session.forward(*side_batch(cfg)[::2])
    assert [g.replays for g in graphed.graphs()] == replays  # nothing replayed
    assert graphed.graphed_callables.pool.order.cursor == 0
    if mode == "graphed_static":
        assert graphed.runtime.sets.in_use == 0
    assert graphed.release_pending() == 0  # nothing was left in flight


def test_release_pending_is_the_documented_call_and_a_released_backward_raises():
    cfg = tiny_run_config()
    session = session_for(cfg, "graphed_static")
    graphed = session.mode_model
    inputs, targets, seed = side_batch(cfg)
    loss = F.cross_entropy(graphed(inputs, seed).flatten(0, 1), targets.flatten())
    assert graphed.runtime.sets.in_use == 1 and graphed.runtime.pending == 1
    assert graphed.release_pending() == 1
    assert graphed.runtime.sets.in_use == 0
    with pytest.raises(StaticRecomputeError, match="backward of a forward that was released"):
        loss.backward()
    # the next forward and backward run normally
    graphed.release_pending()
    F.cross_entropy(graphed(inputs, seed).flatten(0, 1), targets.flatten()).backward()
    assert graphed.runtime.sets.in_use == 0


@pytest.mark.parametrize("mode", compared_modes()[1:])
def test_eval_reaches_the_graphed_sublayers(mode):
    """p = 0.5 makes any dropout visible; eval output and eval gradients equal eager_none's."""
    cfg = tiny_run_config()
    cfg.model.hidden_dropout = 0.5
    inputs, targets, seed = side_batch(cfg)

    def eval_pass(m):
        session = session_for(cfg, m)
        session.model.eval()
        logits = session.forward(inputs, seed)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        return logits.detach(), grad_digest(session.model)

    want_logits, want_grads = eval_pass("eager_none")
    got_logits, got_grads = eval_pass(mode)
    assert torch.equal(got_logits, want_logits) and got_grads == want_grads
    session = session_for(cfg, mode)
    session.model.eval()
    with torch.no_grad():  # and without gradients: the same numbers
        assert torch.equal(session.forward(inputs, seed), want_logits)


@pytest.mark.parametrize("mode", ["graphed_static", "graphed_none"])
def test_changing_what_the_graphs_baked_in_is_refused_naming_the_field(mode):
    cfg = tiny_run_config()
    session = session_for(cfg, mode)
    model, forward = session.model, session.forward
    inputs, _, seed = side_batch(cfg)
    model.cfg.hidden_dropout = 0.5
    with pytest.raises(StaleCaptureError, match=r"model\.hidden_dropout: changed from 0\.2 to 0\.5"):
        forward(inputs, seed)
    model.eval()
    with torch.no_grad():
        forward(inputs, seed)  # evaluation replays nothing: fine
    model.train()
    model.cfg.hidden_dropout = 0.2
    forward(inputs, seed)  # set back: fine
    session.release_pending()
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    with pytest.raises(StaleCaptureError, match="model parameters: replaced or moved"):
        forward(inputs, seed)


@pytest.mark.parametrize("mode", ["graphed_static", "graphed_none"])
def test_a_gradient_the_graphs_add_into_cannot_be_set_to_none(mode):
    """The backward graphs add parameter grads into the optimizer's gradient buffer: a ``.grad``
    set to None (zero_grad(set_to_none=True) of another optimizer) is refused by name."""
    cfg = tiny_run_config()
    session = session_for(cfg, mode)
    inputs, _, seed = side_batch(cfg)
    layer = session.model.layers[0].attention.hc.mapping_proj.weight
    layer.grad = None
    with pytest.raises(StaleCaptureError, match="parameter gradients: set to None or replaced"):
        session.forward(inputs, seed)


def test_changing_the_dtype_after_capture_names_train_dtype():
    cfg = tiny_run_config()
    session = session_for(cfg, "graphed_static")
    session.model.to(torch.bfloat16)
    with pytest.raises(StaleCaptureError, match=r"train\.dtype: changed from torch\.float32"):
        session.forward(*side_batch(cfg)[::2])


@pytest.mark.parametrize("mode, match", [("graphed_static", "shapes are fixed"),
                                         ("graphed_none", "a graph replays fixed shapes")])
def test_another_shape_after_capture_is_refused(mode, match):
    cfg = tiny_run_config()
    session = session_for(cfg, mode)
    inputs = torch.zeros(cfg.train.micro_batch_size + 1, cfg.model.seq_length, dtype=torch.int64)
    with pytest.raises((StaticRecomputeError, ValueError), match=match):
        session.forward(inputs, torch.tensor(1))


def test_compare_json_with_eval_interval_has_identical_eval_losses(tmp_path, capsys):
    path = write_config(tmp_path, """\
model: {vocab_size: 32, seq_length: 8, hidden_size: 16, num_heads: 2, num_layers: 4,
        hidden_dropout: 0.2, recompute: block, recompute_layers: 2}
train: {steps: 4, micro_batch_size: 2, num_microbatches: 2, device: cpu, eval_interval: 2,
        eval_batches: 2}
graph: {backend: auto, cuda_graph_scope: [attn, mlp, mhc_recompute]}
""")
    assert main(["train", "--config", str(path), "--compare", "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["agree"] and report["mismatches"] == []
    modes = report["modes"]
    assert list(modes) == list(compared_modes())
    reference = modes["eager_none"]["eval_losses"]
    assert len(reference) == 2 and modes["eager_none"]["eval_steps"] == [2, 4]
    assert all(torch.isfinite(torch.tensor(reference)))
    for mode, entry in modes.items():
        assert entry["eval_losses"] == reference, mode
        assert entry["grads_equal_eager_none"] and entry["losses_equal_eager_none"], mode
