"""The training step's microbatch loop, written once: the session runs it each step
(:meth:`mhc_cg.training.session.TrainSession.run_step`), and a full-iteration mode captures it
over its static batches (:class:`mhc_cg.runtime.modes.graphed_full.FullIterationModel`, given it
at ``prepare`` as ``ModeModel.step_loop``: the mode calls up only while it captures)."""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from mhc_cg.core.regions import region

Batch = tuple[Tensor, Tensor, Tensor]  # (input ids [b, s], targets [b, s], dropout seed [])


def microbatch_loop(model, batch: Callable[[int], Batch], count: int, *, kernels: str,
                    backward: Callable[[Tensor], None],
                    first: Callable[[Callable[[], Tensor]], Tensor] | None = None) -> Tensor:
    """Each microbatch ``index``'s share of the step's loss, ``model.microbatch_loss`` of
    ``batch(index)`` (drawn in its forward: loading counts with it), then ``backward`` of it, in
    order; returns the summed loss (detached). ``first`` runs the first microbatch's loss (the
    session's memory probe). Nothing here holds a microbatch's logits: its backward frees them, as
    it must inside a captured iteration."""
    loss_sum = None
    for index in range(count):
        with region("forward"):
            loss = _loss(model, batch(index), kernels, count, first if index == 0 else None)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        with region("backward"):
            backward(loss)
    return loss_sum


def _loss(model, batch: Batch, kernels: str, count: int,
          run: Callable[[Callable[[], Tensor]], Tensor] | None) -> Tensor:
    """One microbatch's loss; its batch dies here, before its backward, as nothing reads it."""
    inputs, targets, seed = batch
    del batch

    def loss() -> Tensor:
        return model.microbatch_loss(inputs, targets, seed, kernels, count)

    return loss() if run is None else run(loss)
