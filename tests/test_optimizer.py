"""The training's optimizer: Megatron's step from torch's parts (fp32 main parameters, fused AdamW
bucket by bucket, loss scaling for fp16, a non-finite gradient skips the step on the device)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhc_cg.config import load_config
from mhc_cg.lab.compare.modes import Compared, format_table, mismatches, run_watched
from mhc_cg.training import optimizer as optimizer_module
from mhc_cg.training.optimizer import DynamicLossScaler, MainParamAdamW
from mhc_cg.lab.resolve import train_config
from helpers import REPO, tiny_run_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(),
                               torch.nn.Linear(13, 5)).to(dtype)


def _loss(model: torch.nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step)).to(dtype)
    return model(x).float().square().mean()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_step_equals_torch_fused_adamw_over_per_parameter_fp32_copies(dtype):
    """Buckets of 40 elements cut across parameters; after four steps the model's parameters
    and the fp32 main copies equal torch.optim.AdamW(fused=True) stepping per-parameter fp32
    copies with the gradients cast (and unscaled), bit for bit."""
    dt = DTYPES[dtype]
    ours_model, ref_model = _model(dt), _model(dt)
    opt = MainParamAdamW(ours_model.parameters(), lr=1e-2, weight_decay=0.1, model_dtype=dt,
                         bucket_bytes=40 * 4)
    if opt.scaler is not None:
        opt.scaler.scale = 64.0
    assert opt.main.numel() > 3 * opt.bucket_elements
    mains = [p.detach().float().clone().requires_grad_() for p in ref_model.parameters()]
    ref = torch.optim.AdamW(mains, lr=1e-2, weight_decay=0.1, fused=True)
    scale = opt.loss_scale
    if opt.scaler is not None:  # what torch's GradScaler hands a fused optimizer
        ref.grad_scale, ref.found_inf = torch.tensor(scale), torch.tensor(0.0)
    for step in range(4):
        opt.backward(_loss(ours_model, step, dt))
        result = opt.step()
        assert result.found_inf.item() == 0
        (_loss(ref_model, step, dt) * scale).backward()
        for m, p in zip(mains, ref_model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref.step()
        with torch.no_grad():
            for m, p in zip(mains, ref_model.parameters()):
                p.copy_(m)
    for ours, theirs in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(ours, theirs)
    assert torch.equal(opt.main, torch.cat([m.detach().reshape(-1) for m in mains]))
    assert opt.step_count.item() == 4


def test_parameters_and_gradients_are_views_of_one_buffer_each_at_fixed_addresses():
    model = _model(torch.bfloat16)
    opt = MainParamAdamW(model.parameters(), lr=1e-2, weight_decay=0.0,
                         model_dtype=torch.bfloat16)
    ptrs = [(p.data_ptr(), p.grad.data_ptr()) for p in model.parameters()]
    flat, grads = opt.flat.untyped_storage(), opt.grads.untyped_storage()
    assert all(p.untyped_storage().data_ptr() == flat.data_ptr() for p in model.parameters())
    assert all(p.grad.untyped_storage().data_ptr() == grads.data_ptr() for p in model.parameters())
    for step in range(2):
        opt.backward(_loss(model, step, torch.bfloat16))
        assert opt.grads.abs().sum() > 0  # autograd accumulated into the views
        opt.step()
        assert not opt.grads.any()  # consumed: zero for the next step's accumulation
    assert [(p.data_ptr(), p.grad.data_ptr()) for p in model.parameters()] == ptrs
    assert all(t.dtype == torch.float32 for t in (opt.main, opt.exp_avg, opt.exp_avg_sq))


class _Reads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_a_step_reads_nothing_back_and_a_non_finite_gradient_skips_it_on_the_device():
    model = _model(torch.float16)
    opt = MainParamAdamW(model.parameters(), lr=1e-2, weight_decay=0.0,
                         model_dtype=torch.float16, bucket_bytes=64)
    opt.scaler.scale = 8.0
    before = [p.detach().clone() for p in model.parameters()]
    main_before = opt.main.clone()
    for _ in range(opt.scaler.hysteresis):
        opt.backward(_loss(model, 0, torch.float16))
        model[0].weight.grad[0, 0] = float("inf")
        with _Reads() as reads:
            result = opt.step()
        assert "aten._local_scalar_dense" not in reads.ops and "aten.item" not in reads.ops
        assert result.found_inf.item() == 1
        opt.update(True)
    assert opt.skipped_steps == opt.scaler.hysteresis
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(opt.main, main_before) and opt.step_count.item() == 0
    assert opt.loss_scale == 8.0 * opt.scaler.backoff_factor
    assert not opt.grads.any()


def test_the_norm_is_the_unscaled_gradients_norm():
    model = _model(torch.float16)
    opt = MainParamAdamW(model.parameters(), lr=1e-2, weight_decay=0.0,
                         model_dtype=torch.float16)
    opt.scaler.scale = 32.0
    opt.backward(_loss(model, 0, torch.float16))
    want = torch.linalg.vector_norm(opt.grads.float()) / 32.0
    result = opt.step()
    assert result.grad_norm.item() == pytest.approx(want.item(), rel=1e-6)


def test_a_lent_workspace_is_the_staging_bucket_and_nothing_else_is_allocated():
    model = _model(torch.bfloat16)
    opt = MainParamAdamW(model.parameters(), lr=1e-2, weight_decay=0.0,
                         model_dtype=torch.bfloat16, bucket_bytes=64)
    lent = torch.empty(100, dtype=torch.uint8)
    opt.reserve_staging(lent)
    assert opt.staging is None  # the workspace holds a bucket: no own staging
    opt.backward(_loss(model, 0, torch.bfloat16))
    opt.step(lent)
    assert opt.staging is None
    opt.backward(_loss(model, 1, torch.bfloat16))
    opt.step(torch.empty(8, dtype=torch.uint8))  # too small for a bucket: the own one
    assert opt.staging is not None and opt.staging.numel() == 16


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="no parameter requires a gradient"):
        MainParamAdamW([torch.nn.Parameter(torch.ones(2), requires_grad=False)], lr=1.0,
                       weight_decay=0.0, model_dtype=torch.float32)
    with pytest.raises(ValueError, match="must be torch.bfloat16"):
        MainParamAdamW([torch.nn.Parameter(torch.ones(2))], lr=1.0, weight_decay=0.0,
                       model_dtype=torch.bfloat16)


def test_loss_scale_grows_after_clean_steps():
    scaler = DynamicLossScaler(scale=4.0, growth_interval=3)
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(True)
    scaler.update(True)  # hysteresis 2: the second overflow in a row backs off
    assert scaler.scale == 4.0


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_tiny_config_trains_with_finite_falling_losses_identical_across_modes(dtype):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=dtype, steps=12,
                                                              device="cpu"))
    eager = run_watched(cfg, "eager_none")
    graphed = run_watched(cfg, "graphed_static")
    assert all(math.isfinite(v) for v in eager.losses)
    assert eager.losses[-1] < eager.losses[0] - 0.1, eager.losses
    assert eager.skipped_steps == []  # the initial fp16 scale fits this model
    assert graphed.losses == eager.losses and graphed.grad_digests == eager.grad_digests


def test_skipped_steps_are_reported_by_train(monkeypatch):
    """A step whose gradients overflow is counted in ``skipped_steps`` (forced here by an
    initial scale that overflows fp16 at once)."""
    monkeypatch.setattr(optimizer_module, "DynamicLossScaler",
                        lambda: DynamicLossScaler(scale=2.0 ** 40))
    result = train_config(tiny_run_config(dtype="fp16", steps=3), mode="eager_none", progress=False)
    assert result.skipped_steps == [0, 1, 2]
    assert all(math.isfinite(v) for v in result.losses)


def test_nan_losses_are_not_shown_as_equal():
    nan = float("nan")
    results = {"eager_none": Compared("eager_none", losses=[4.0, nan], grad_norms=[1.0, nan],
                                         step_times=[0.1, 0.1]),
               "graphed_static": Compared("graphed_static", losses=[4.0, nan],
                                             grad_norms=[1.0, nan], step_times=[0.1, 0.1])}
    table = format_table(results)
    assert "not finite" in table and "max diff 0" not in table
    assert any("not finite" in line for line in mismatches(results))
