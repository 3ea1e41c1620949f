"""Build the model and the forward that one capture plan trains with."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import Tensor

from mhc_cg.config import RunConfig
from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.model import MHCGPT
from mhc_cg.runtime.modes.plan import CapturePlan, capture_plan


def build_for_plan(cfg: RunConfig, plan: CapturePlan, device: torch.device, backend=None
                   ) -> tuple[MHCGPT, Callable[[Tensor, Tensor], Tensor], object | None]:
    """``(model, forward, graphed)``; ``forward(input_ids, seed) -> logits``; ``graphed`` is the
    graphed wrapper (``None`` in the eager modes). ``backend``: a ``GraphBackend`` object to
    capture with instead of the plan's (the cost model's recording backend).

    The weights depend only on ``cfg.train.seed``, never on the mode, so modes can be compared.
    """
    # The "none" modes are the references: no recompute of any kind. Activation recompute frees
    # a storage, which no graph can hold, so graphed_none could not capture it anyway.
    no_recompute = plan.mode in ("eager_none", "graphed_none")
    model_cfg = dataclasses.replace(
        cfg.model, recompute="block" if plan.mode in ("eager_block", "attn_split") else "none",
        recompute_activation=cfg.model.recompute_activation and not no_recompute,
        recompute_activation_layers=None if no_recompute else cfg.model.recompute_activation_layers)
    torch.manual_seed(cfg.train.seed)
    # weights are made in fp32 (same init for every dtype), then cast
    model = MHCGPT(model_cfg).to(device=device, dtype=TORCH_DTYPES[cfg.train.dtype]).train()
    if plan.mode == "graphed_none":
        from mhc_cg.runtime.modes.graphed_none import GraphedSublayersModel

        graphed = GraphedSublayersModel(model, plan, micro_batch_size=cfg.train.micro_batch_size,
                                        backend=backend)
    elif plan.mode == "graphed_static":
        from mhc_cg.runtime.modes.graphed_static import GraphedStaticModel

        graphed = GraphedStaticModel(model, plan, micro_batch_size=cfg.train.micro_batch_size,
                                     backend=backend)
    elif plan.mode == "attn_split":
        from mhc_cg.runtime.modes.attn_split import AttnSplitModel

        graphed = AttnSplitModel(model, plan, micro_batch_size=cfg.train.micro_batch_size,
                                 backend=backend)
    else:
        return model, model, None
    with torch.enable_grad():  # capture records the backward too, even if built under no_grad
        graphed.prepare(device)
    return model, graphed, graphed


def build_for_mode(cfg: RunConfig, mode: str, device: torch.device
                   ) -> tuple[MHCGPT, Callable[[Tensor, Tensor], Tensor], object | None]:
    """:func:`build_for_plan` with the plan of ``mode`` on ``device``."""
    return build_for_plan(cfg, capture_plan(cfg, mode, str(device)), device)
