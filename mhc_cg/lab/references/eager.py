"""Modes ``eager_none`` and ``eager_block``: the model run eagerly, with or without block recompute.

``eager_none`` (no recompute of any kind) is the reference every other mode must equal bit for bit.
``eager_block`` frees each recompute block's mHC intermediates after the block and recomputes them
from one hook on the block's end tensor (:mod:`mhc_cg.recompute.block_recompute`); the MLPs that ask
for activation recompute recompute their gelu eagerly in both modes where the mode keeps it.
"""

from __future__ import annotations

from torch import Tensor

from mhc_cg.modes.lifecycle import ModeModel, runs_graphs
from mhc_cg.recompute.block_recompute import BlockRecomputeManager, run_recompute_blocks


class EagerModel(ModeModel):
    """The model itself; with ``model.cfg.recompute == "block"`` a training forward runs eager
    block recompute and ``recompute_managers`` holds that forward's managers."""

    def __init__(self, model, plan=None, *, micro_batch_size: int = 0, new_api=None):
        super().__init__(model, plan, micro_batch_size=micro_batch_size, new_api=new_api)
        self.block_recompute = model.cfg.recompute == "block"
        self.recompute_managers: list[BlockRecomputeManager] = []

    def forward(self, input_ids: Tensor, dropout_seed: Tensor | None = None) -> Tensor:
        model = self.model
        if not (self.block_recompute and runs_graphs(model)):  # evaluation: nothing to recompute
            return model(input_ids, dropout_seed)
        seed = model.dropout_seed_for(input_ids, dropout_seed)
        self.recompute_managers = []
        x = run_recompute_blocks(model.layers, model.embed(input_ids), seed,
                                 model.cfg.resolved_recompute_layers, self.recompute_managers,
                                 draws_random=model.cfg.draws_random)
        return model.logits(x)

    def describe(self) -> dict:
        return {}
