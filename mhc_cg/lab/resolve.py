"""A run resolved once, in one place (:func:`resolve`): the mode (from the lab's registry, which
knows every mode), its config, what refuses it, the device and whether the run fits, the capture
plan and the capture API; :func:`refusal` says the same for a tool that lists the modes it
leaves out; :func:`train_config` trains a config as ``mhc-cg train`` does."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from mhc_cg.config import RunConfig, check
from mhc_cg.config.rules import megatron_only_refusal
from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.emulation.backends import graph_api, resolve_backend_name
from mhc_cg.lab.registry import arithmetic_refusal, configured_mode, get_mode
from mhc_cg.model import MHCGPT
from mhc_cg.modes.plan import CapturePlan
from mhc_cg.training.device import check_fits, resolve_device
from mhc_cg.training.run import Run
from mhc_cg.training.session import TrainResult, train


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
    if (refused := arithmetic_refusal(cfg, spec.name)) is not None:
        raise ConfigError(refused)
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
    return Run(cfg, spec, model, CapturePlan(spec.name, api=api, **spec.capture(cfg)), device,
               functools.partial(graph_api, api))


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
    if (refused := megatron_only_refusal(cfg) or arithmetic_refusal(cfg, mode)):
        return refused
    return spec.unavailable(cfg, device) if spec.unavailable is not None else None




def train_config(cfg: RunConfig, *, steps: int | None = None, device: str | None = None,
                 progress: bool = True, mode: str | None = None,
                 after_backward: Callable[[int, MHCGPT], None] | None = None,
                 first_microbatch: Callable[[int, Callable[[], torch.Tensor]], torch.Tensor] | None = None,
                 ) -> TrainResult:
    """Train ``cfg.model`` on the synthetic corpus in ``mode`` (default: what the config asks),
    resolved once (:func:`resolve`), then :func:`mhc_cg.training.session.train` with the tool's
    hooks. One process: a config with ``parallel.pp_size > 1`` runs on
    :func:`mhc_cg.lab.pipeline.driver.train_pipeline` (one process per pipeline rank)."""
    run = resolve(cfg, mode, device)
    if run.cfg.parallel.pp_size > 1:
        raise ConfigError(f"parallel.pp_size: train() runs one process; a pipeline of "
                          f"{run.cfg.parallel.pp_size} ranks runs on train_pipeline() (mhc-cg "
                          f"train starts it)")
    return train(run, steps=steps, progress=progress, after_backward=after_backward,
                 first_microbatch=first_microbatch)
