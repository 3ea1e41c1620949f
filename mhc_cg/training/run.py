"""One run, resolved once at its entry: :func:`resolve` decides the mode, its config, what refuses
it, whether it fits the device and its capture plan, in one place, into one :class:`Run` that
the session and every tool take; :func:`build_model` and :func:`prepare` make the run's model
and its mode's captures from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from mhc_cg.config import MHCGPTConfig, RunConfig, check
from mhc_cg.config.rules import megatron_only_refusal
from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.core.errors import ConfigError
from mhc_cg.model import MHCGPT
from mhc_cg.runtime.graphs import GraphBackend, resolve_backend_name
from mhc_cg.runtime.modes.lifecycle import ModeModel
from mhc_cg.runtime.modes.plan import CapturePlan
from mhc_cg.runtime.modes.registry import Mode, configured_mode, get_mode
from mhc_cg.runtime.recompute.block_recompute import recompute_activation_eagerly
from mhc_cg.training.device import check_fits, resolve_device


@dataclass(frozen=True)
class Run:
    """One run, resolved once at its entry (:func:`resolve`) and passed down: the mode, its
    config (its variant applied, checked), the model as the mode builds it, the capture plan and
    the device. Nothing downstream looks any of it up again."""

    cfg: RunConfig
    mode: Mode
    model: MHCGPTConfig
    plan: CapturePlan
    device: torch.device


def resolve(cfg: RunConfig, mode: str | None = None, device: torch.device | str | None = None,
            *, on_this_machine: bool = True, **variant) -> Run:
    """``cfg`` as mode ``mode`` (default: :func:`configured_mode`) trains it on ``device``
    (default: ``train.device``; ``auto`` resolved here), decided in this one place: the mode's
    config (``variant``: options of a variant mode, e.g. ``moe_experts``; checked once), what
    refuses it (:func:`refusal`: one line naming the field, raised as ``ConfigError``), whether
    it fits the device, the model settings the mode implies and the capture plan.

    ``on_this_machine=False`` resolves a config meant for another machine (``config check``):
    the device is taken as named and neither the GPU nor the fit is asked.
    """
    spec = get_mode(mode or configured_mode(cfg))
    cfg = check(spec.configure(cfg, **variant)) if spec.configure is not None else cfg
    named = device or cfg.train.device
    device = _device(named, on_this_machine)
    if on_this_machine:
        if (refused := megatron_only_refusal(cfg)) is not None:
            raise ConfigError(refused)
        if spec.unavailable is not None and (reason := spec.unavailable(cfg, device.type)):
            raise ConfigError(f"mode {spec.name}: {reason}")
        if device.type != "meta":  # the cost model's: nothing is allocated, no kernel runs
            check_fits(cfg, device)
    keeps_activation = spec.recompute_activation
    model = dataclasses.replace(
        cfg.model, recompute=spec.recompute,
        recompute_activation=cfg.model.recompute_activation and keeps_activation,
        recompute_activation_layers=cfg.model.recompute_activation_layers if keeps_activation
        else None)
    try:
        api = resolve_backend_name(cfg.graph.backend, device.type if on_this_machine else named,
                                   on_this_machine=on_this_machine)
    except ValueError as exc:
        raise ConfigError(f"graph.backend: {exc}") from None
    return Run(cfg, spec, model, CapturePlan(spec.name, api=api, **spec.capture(cfg)), device)


def _device(named: torch.device | str, on_this_machine: bool) -> torch.device:
    """The device a run names: ``meta`` is the cost model's; ``auto`` and ``cuda`` are asked of
    this machine, unless the run is meant for another (``auto`` then stands for the CPU)."""
    if isinstance(named, torch.device):
        return named
    if named == "meta":
        return torch.device("meta")
    if not on_this_machine:
        return torch.device("cpu" if named == "auto" else named)
    return resolve_device(named)


def refusal(cfg: RunConfig, mode: str, device: str) -> str | None:
    """Why mode ``mode`` cannot train ``cfg`` on a ``device`` (``meta``, ``cpu``, ``cuda``): one
    line naming the field, or ``None``; what :func:`resolve` raises, for a tool that lists the
    modes it leaves out instead."""
    spec = get_mode(mode)
    cfg = check(spec.configure(cfg)) if spec.configure is not None else cfg
    if (refused := megatron_only_refusal(cfg)) is not None:
        return refused
    return spec.unavailable(cfg, device) if spec.unavailable is not None else None


def build_model(run: Run) -> MHCGPT:
    """The run's model, in ``train.dtype`` on its device.

    The weights depend only on ``cfg.train.seed``, never on the mode, so modes can be compared.
    """
    torch.manual_seed(run.cfg.train.seed)
    # weights are made in fp32 (same init for every dtype), then cast
    model = MHCGPT(run.model, recompute_activation_eagerly).to(
        device=run.device, dtype=TORCH_DTYPES[run.cfg.train.dtype]).train()
    return model


def prepare(run: Run, model: MHCGPT, backend: GraphBackend | None = None,
            step_loop: Callable | None = None) -> ModeModel:
    """``model`` (from :func:`build_model`) as the run's mode runs it, graphs captured: after
    this, the parameters' addresses are baked into the graphs. ``backend``: a capture backend
    object instead of the plan's (the cost model's); ``step_loop``: the training step's
    microbatch loop (:func:`mhc_cg.training.session.microbatch_loop` with the optimizer's
    backward), which a full-iteration mode is made with, to capture."""
    model_type = run.mode.model_type
    loop = {"step_loop": step_loop} if model_type.captures_iteration else {}
    mode_model = model_type(model, run.plan, micro_batch_size=run.cfg.train.micro_batch_size,
                            backend=backend, **loop)
    with torch.enable_grad():  # capture records the backward too, even if built under no_grad
        mode_model.prepare(run.device)
    return mode_model


def build(run: Run, backend: GraphBackend | None = None) -> ModeModel:
    """The prepared :class:`ModeModel` of the run: model built, graphs captured (for a model
    without an optimizer; training lays its parameters out in between)."""
    return prepare(run, build_model(run), backend)
