"""The training step's microbatch loop, written once: the eager step runs it
(:meth:`mhc_cg.training.session.TrainSession.run_step`) and a full-iteration mode captures it
(:class:`mhc_cg.runtime.modes.graphed_full.FullIterationModel`), each with its own way to make a
microbatch's loss and the backward its owner gives it."""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from mhc_cg.core.nvtx import step_phase


def microbatch_loop(count: int, forward_loss: Callable[[int], Tensor],
                    backward: Callable[[Tensor], None]) -> Tensor:
    """Each microbatch ``index``'s ``forward_loss(index)`` (its share of the step's loss), then
    ``backward`` of it, in order; returns the summed loss (detached). Nothing here holds a
    microbatch's logits: its backward frees them, as it must inside a captured iteration."""
    loss_sum = None
    for index in range(count):
        with step_phase("forward"):
            loss = forward_loss(index)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        with step_phase("backward"):
            backward(loss)
    return loss_sum
