"""Mixed precision as Megatron does it: fp32 main parameters and AdamW state, bf16/fp16 model,
dynamic loss scaling for fp16 with skipped steps reported; non-finite losses never compare equal."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mhc_cg.tools.compare import format_table, mismatches
from mhc_cg.config import load_config
from mhc_cg.training.mixed_precision import DynamicLossScaler, MixedPrecisionOptimizer
from mhc_cg.training.session import TrainResult, train
from helpers import REPO, tiny_run_config


def tiny_cpu(dtype: str, steps: int):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=dtype, steps=steps,
                                                              device="cpu"))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_tiny_config_trains_with_finite_falling_losses_identical_across_modes(dtype):
    cfg = tiny_cpu(dtype, steps=12)
    eager = train(cfg, mode="eager_none", progress=False)
    graphed = train(cfg, mode="graphed_static", progress=False)
    assert all(math.isfinite(v) for v in eager.losses)
    assert eager.losses[-1] < eager.losses[0] - 0.1, eager.losses
    assert eager.skipped_steps == []  # the initial fp16 scale fits this model
    assert graphed.losses == eager.losses and graphed.grad_digests == eager.grad_digests


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_main_parameters_are_fp32_and_model_parameters_keep_their_address(dtype):
    model = torch.nn.Linear(4, 4).to(dtype)
    ptrs = [p.data_ptr() for p in model.parameters()]
    opt = MixedPrecisionOptimizer(model.parameters(), lr=1e-2, weight_decay=0.0, model_dtype=dtype)
    if opt.scaler is not None:
        opt.scaler.scale = 1024.0  # 2**16 would overflow this loss's fp16 gradients (a skip)
    assert all(m.dtype == torch.float32 for m in opt.main_params)
    opt.zero_grad()
    opt.backward(model(torch.ones(2, 4, dtype=dtype)).float().square().sum())
    norm, skipped = opt.step()
    assert not skipped and math.isfinite(norm)
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # graphs keep reading them
    for p, m in zip(model.parameters(), opt.main_params):
        assert torch.equal(p, m.to(dtype))
    state = opt.optimizer.state[opt.main_params[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


def test_fp16_overflow_skips_the_step_keeps_parameters_and_backs_off():
    model = torch.nn.Linear(4, 4).to(torch.float16)
    opt = MixedPrecisionOptimizer(model.parameters(), lr=1e-2, weight_decay=0.0,
                                  model_dtype=torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    scale = opt.loss_scale
    for _ in range(opt.scaler.hysteresis):
        opt.zero_grad()
        opt.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum())
        model.weight.grad[0, 0] = float("inf")
        _, skipped = opt.step()
        assert skipped
    assert opt.skipped_steps == opt.scaler.hysteresis
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.loss_scale == scale * opt.scaler.backoff_factor


def test_loss_scale_grows_after_clean_steps():
    scaler = DynamicLossScaler(scale=4.0, growth_interval=3)
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(True)
    scaler.update(True)  # hysteresis 2: the second overflow in a row backs off
    assert scaler.scale == 4.0


def test_skipped_steps_are_reported_by_train(monkeypatch):
    """A step whose gradients overflow is counted in ``skipped_steps`` (forced here by an
    initial scale that overflows fp16 at once)."""
    from mhc_cg.training import mixed_precision

    monkeypatch.setattr(mixed_precision, "DynamicLossScaler",
                        lambda: DynamicLossScaler(scale=2.0 ** 40))
    result = train(tiny_run_config(dtype="fp16", steps=3), mode="eager_none", progress=False)
    assert result.skipped_steps == [0, 1, 2]
    assert all(math.isfinite(v) for v in result.losses)


def test_nan_losses_are_not_shown_as_equal():
    nan = float("nan")
    results = {"eager_none": TrainResult("eager_none", losses=[4.0, nan], grad_norms=[1.0, nan],
                                         step_times=[0.1, 0.1]),
               "graphed_static": TrainResult("graphed_static", losses=[4.0, nan],
                                             grad_norms=[1.0, nan], step_times=[0.1, 0.1])}
    table = format_table(results)
    assert "not finite" in table and "max diff 0" not in table
    assert any("not finite" in line for line in mismatches(results))
