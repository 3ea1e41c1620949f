"""Full-iteration capture (``graphed_full``, ``graphed_full_static``): one replay per step whose
gradients equal eager's bit for bit, what it refuses by name, and what it costs."""

from __future__ import annotations

import pytest
import torch

from mhc_cg.core.errors import ConfigError, StaleCaptureError
from mhc_cg.lab.resolve import resolve
from mhc_cg.lab.cost.report import cost_mode, mode_configs
from mhc_cg.lab.compare.modes import run_watched
from mhc_cg.training.session import TrainSession
from mhc_cg.lab.resolve import train_config

from helpers import tiny_run_config

FULL = ("graphed_full", "graphed_full_static")


def digests(cfg, mode):
    result = run_watched(cfg, mode)
    return result.losses, result.grad_digests


@pytest.mark.parametrize("dropout_impl, dropout, modes", [
    ("counter", 0.2, FULL),           # counter dropout: nothing to rewind, in either mode
    ("torch", 0.0, ("graphed_full",)),  # Megatron's own setting: its generator, dropout 0
])
def test_one_replay_per_step_gives_eager_gradients_bit_for_bit(dropout_impl, dropout, modes):
    """Two microbatches per iteration, three steps: losses and every gradient equal eager_none's."""
    cfg = tiny_run_config(scopes=("attn",)).replace(
        model={"dropout_impl": dropout_impl, "hidden_dropout": dropout})
    reference = digests(cfg, "eager_none")
    for mode in modes:
        assert digests(cfg, mode) == reference, mode


@pytest.mark.parametrize("change, field", [
    ({"train": {"dtype": "fp16"}}, "train.dtype: fp16's loss scale moves on the host"),
    ({"model": {"dropout_impl": "torch"}}, "model.dropout_impl: 'torch' draws the mask"),
])
def test_what_an_iteration_cannot_hold_is_refused_by_name(change, field):
    cfg = tiny_run_config(scopes=("attn",)).replace(**change)
    for mode in FULL:
        with pytest.raises(ConfigError) as info:
            train_config(cfg, mode=mode, progress=False)
        assert str(info.value).startswith(f"mode {mode}: {field}") and "\n" not in str(info.value)


@pytest.mark.parametrize("mode", FULL)
def test_a_step_refuses_what_the_capture_baked_in(mode):
    cfg = tiny_run_config()
    session = TrainSession.build(resolve(cfg, mode, "cpu"))
    session.step()
    session.model.cfg.hidden_dropout = 0.5
    with pytest.raises(StaleCaptureError, match=r"model\.hidden_dropout: changed from 0\.2"):
        session.step()
    session.model.cfg.hidden_dropout = 0.2
    session.model.layers[0].attention.hc.mapping_proj.weight.grad = None
    with pytest.raises(StaleCaptureError, match="parameter gradients: set to None"):
        session.step()
    wrong = torch.zeros(cfg.train.micro_batch_size + 1, cfg.model.seq_length, dtype=torch.int64)
    batches = [(wrong, wrong, torch.tensor(1))] * cfg.train.num_microbatches
    with pytest.raises(ValueError, match=r"^microbatch 0's inputs is \[3, 8\] torch.int64"):
        TrainSession.build(resolve(cfg, mode, "cpu")).mode_model.run_iteration(batches)


def test_the_static_iteration_moves_fewer_bytes_and_peaks_no_higher():
    """The cost model at a width where the mHC intermediates outweigh the rest: each full mode is
    one replay plus the step's copies in and the optimizer apart; graphed_full costs eager block
    recompute's bytes at its peak, graphed_full_static the static runtime's bytes below it."""
    cfg = tiny_run_config(microbatches=2).replace(
        model={"seq_length": 64, "hidden_size": 256, "num_heads": 4})
    costed = dict(mode_configs(cfg, "meta")[0])
    m = {mode: cost_mode(costed[mode])
         for mode in ("eager_none", "eager_block", *FULL)}
    optimizer = m["eager_none"]["kernels_by_phase"]["optimizer"]
    for mode in FULL:
        assert m[mode]["graph_replays_per_step"] == 1, mode
        # outside the graph: each microbatch's batch to the device and into the static
        # buffers (inputs, targets, seed), then the optimizer
        assert m[mode]["eager_kernels_per_step"] == optimizer + 6 * 2, mode
    full, static = m["graphed_full"], m["graphed_full_static"]
    copied_in = full["copy_bytes_per_step"]["static inputs"]  # the batches, into the graph's
    assert full["bytes_per_step"] == m["eager_block"]["bytes_per_step"] + copied_in
    # the pool reuses what eager block recompute frees as its allocator does: the same peak,
    # plus the static batch buffers and a few 512-byte blocks of scalars
    assert full["peak_bytes"] <= m["eager_block"]["peak_bytes"] + full["static_buffer_bytes"] + 8 * 512
    assert static["bytes_per_step"] < full["bytes_per_step"]
    assert static["peak_bytes"] <= full["peak_bytes"]
    assert static["step_s"]["low"] < full["step_s"]["low"]
    assert static["step_s"]["high"] < full["step_s"]["high"]
