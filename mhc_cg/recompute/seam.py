"""The seam between two fused sublayers in eager block recompute, where the post before hands the
pre after its state (:class:`~mhc_cg.ops.kernels.Handoff`) although each runs in a checkpoint
of its own: both checkpoints' functions hold the seam (:class:`Relay`), given on the call path."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mhc_cg.model.sublayer import hands_state
from mhc_cg.ops.kernels import Handoff


@dataclass(eq=False)
class Relay:
    """One seam between two fused sublayers in eager block recompute: the post before fills it
    each time it runs (the forward, and its recompute), the pre after takes it. A pre recomputed
    from a refilled input reads another tensor than the one the handoff is for, so it computes
    its own state, as it must (its input is a new leaf)."""

    handoff: Handoff | None = None

    def take(self) -> Handoff | None:
        handoff, self.handoff = self.handoff, None
        return handoff


def taking_pre(pre, seam: Relay):
    """``pre(x, handoff=...)`` with what ``seam`` holds when it runs."""
    def run(x: Tensor, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
        return pre(x, handoff=seam.take(), **kwargs)
    return run


def handing_post(steps, nxt, seam: Relay):
    """``steps``' post, handing ``nxt`` its state through ``seam`` where it can."""
    def run(x_on: Tensor, state: Tensor, y: Tensor, seed: Tensor | None) -> Tensor:
        if not hands_state(steps, nxt):
            return steps.post(x_on, state, y, seed)
        out, seam.handoff = steps.post_feeding(nxt, x_on, state, y, seed)
        return out
    return run
