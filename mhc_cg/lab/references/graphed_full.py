"""Mode ``graphed_full``: eager block recompute inside one captured iteration, as Megatron's
``FullCudaGraphWrapper`` captures it (:mod:`mhc_cg.modes.full_iteration`): the reference the
static runtime's full-iteration mode is measured against."""

from __future__ import annotations

from mhc_cg.lab.references.eager import EagerModel
from mhc_cg.modes.full_iteration import FullIterationModel


class FullEagerModel(FullIterationModel):
    """``graphed_full``: eager block recompute inside one captured iteration (Megatron's)."""

    inner_type = EagerModel
