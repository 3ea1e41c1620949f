"""A training mode (:class:`Mode`) and one run of it (:class:`Run`), resolved once at its entry
(the lab's :func:`mhc_cg.lab.resolve.resolve`, which knows every mode) into one object that the
session and every tool take; :func:`build_model` and :func:`prepare` make the run's model and its
mode's captures from it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from mhc_cg.config import MHCGPTConfig, RunConfig
from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.graphs import GraphBackend
from mhc_cg.graphs.te import GraphAPI
from mhc_cg.model import MHCGPT
from mhc_cg.modes.lifecycle import ModeModel
from mhc_cg.modes.plan import CapturePlan
from mhc_cg.recompute.block_recompute import recompute_activation_eagerly


@dataclass(frozen=True)
class Mode:
    """One training mode.

    ``recompute``: the ``model.recompute`` the model is built with (``block``: the mode runs eager
    block recompute itself); ``recompute_activation``: whether ``model.recompute_activation``
    applies. ``capture(cfg)``: the :class:`CapturePlan` fields beyond mode and api.
    ``model_type`` runs it. ``same_model``: it trains the configured model, so ``--compare`` holds
    it to the reference bit for bit. ``pipelines``: the multi-process pipeline driver runs it.
    ``configure(cfg, **variant)``: the config it trains (a variant of the given one), ``None``:
    the given one. ``unavailable(cfg, device)``: why it cannot run there, or ``None``.
    """

    name: str
    summary: str
    model_type: type[ModeModel]
    recompute: str = "none"
    recompute_activation: bool = True
    capture: Callable[[RunConfig], dict] = lambda cfg: {}
    same_model: bool = True
    pipelines: bool = False
    configure: Callable[..., RunConfig] | None = None
    unavailable: Callable[[RunConfig, str], str | None] | None = None

    @property
    def graphed(self) -> bool:
        return self.model_type.graphed


@dataclass(frozen=True)
class Run:
    """One run, resolved once at its entry and passed down: the mode, its config (its variant
    applied, checked), the model as the mode builds it, the capture plan, the device, and
    ``graph_api(backend)``: the capture API of the plan's ``api`` over ``backend`` (``None``: its
    own), which the resolution picked (CUDA graphs and an installed TE are the product's
    :func:`mhc_cg.graphs.te.graph_api`; the tape and TE's wheel, the lab's). Nothing downstream
    looks any of it up again."""

    cfg: RunConfig
    mode: Mode
    model: MHCGPTConfig
    plan: CapturePlan
    device: torch.device
    graph_api: Callable[[GraphBackend | None], GraphAPI]


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
                            new_api=functools.partial(run.graph_api, backend), **loop)
    with torch.enable_grad():  # capture records the backward too, even if built under no_grad
        mode_model.prepare(run.device)
    return mode_model


def build(run: Run, backend: GraphBackend | None = None) -> ModeModel:
    """The prepared :class:`ModeModel` of the run: model built, graphs captured (for a model
    without an optimizer; training lays its parameters out in between)."""
    return prepare(run, build_model(run), backend)
