"""The training loop behind ``mhc-cg train``, and the one training step every tool runs.

Each step first releases whatever an aborted previous step left in flight (a forward whose
backward never came), then runs ``num_microbatches`` forwards and backwards and one optimizer
step (:mod:`mhc_cg.training.optimizer`: fp32 main parameters, fused AdamW, loss scaling for
fp16). :meth:`TrainSession.run_step` leaves the loss, the norm and the skip flag on the device;
:meth:`TrainSession.step` reads them back in one synchronisation. The cost model records
``run_step`` itself, so what it costs is what training runs.
With ``train.eval_interval`` the model is evaluated every that many steps on
``train.eval_batches`` held-out batches (a generator of its own, so training sees the same data
with and without evaluation), under ``eval()`` and ``no_grad``: a forward-only pass.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Iterable

import torch

from mhc_cg.config import RunConfig
from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.core.errors import ConfigError
from mhc_cg.core.regions import region
from mhc_cg.core.progress import ProgressBar
from mhc_cg.model import MHCGPT, lm_loss
from mhc_cg.modes.lifecycle import ModeModel
from mhc_cg.modes.plan import CapturePlan
from mhc_cg.graphs import GraphBackend
from mhc_cg.training.data import ProgressionCorpus
from mhc_cg.training.run import Run, build_model, prepare
from mhc_cg.runtime.arena import Arena
from mhc_cg.training.optimizer import MainParamAdamW, StepResult

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (input ids [b, s], targets, seed [])
# a tool's wrapper around the first microbatch's loss: ``first(loss)`` returns ``loss()``
FirstMicrobatch = Callable[[Callable[[], torch.Tensor]], torch.Tensor]


@dataclass
class TrainResult:
    mode: str
    info: dict = field(default_factory=dict)  # the graphed runtime's sizes (arena, sets, graphs)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)  # steps whose gradients overflowed
    eval_steps: list[int] = field(default_factory=list)  # after how many steps each evaluation ran
    eval_losses: list[float] = field(default_factory=list)

    @property
    def median_step_ms(self) -> float:
        times = sorted(self.step_times[1:] or self.step_times)  # the first step pays warm-up
        return 1000.0 * times[len(times) // 2]


class Microbatches:
    """Training data and dropout seeds, drawn per microbatch in one fixed sequence: every mode,
    and every rank of a pipeline, sees the same batches and the same masks."""

    def __init__(self, cfg: RunConfig):
        self.micro_batch_size = cfg.train.micro_batch_size
        self.corpus = ProgressionCorpus(cfg.model.vocab_size, cfg.model.seq_length,
                                        seed=cfg.train.seed)
        self.seeds = torch.Generator().manual_seed(cfg.train.seed + 1)

    def next(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(inputs, targets, dropout seed)`` of the next microbatch, on ``device``."""
        inputs, targets = (t.to(device) for t in self.corpus.batch(self.micro_batch_size))
        seed = torch.randint(0, 2 ** 31 - 1, (), generator=self.seeds).to(device)
        return inputs, targets, seed


@dataclass
class TrainSession:
    """What one mode trains with: the mode's model (:class:`ModeModel`), optimizer and data.

    Dropout seeds come from their own generator, one per microbatch, so every mode sees the
    same masks; the weights depend only on ``cfg.train.seed``.
    """

    run: Run
    mode_model: ModeModel
    optimizer: MainParamAdamW
    data: Microbatches
    # memory the mode leaves idle between steps, lent to the optimizer's temporaries: the static
    # runtime's arena (Arena.borrow); None without one
    workspace: Arena | None = None
    last_skipped: bool = False  # the last step's gradients overflowed and it was skipped
    _eval_data: list | None = None

    @classmethod
    def build(cls, run: Run, backend: GraphBackend | None = None,
              optimizer: Callable[[RunConfig, Iterable], MainParamAdamW] | None = None,
              ) -> "TrainSession":
        """Model, optimizer (which lays the parameters out), then the mode's captures.
        ``optimizer``: a factory instead of :func:`optimizer_for` (the cost model's back-test)."""
        model = build_model(run)
        optimizer = (optimizer or optimizer_for)(run.cfg, model.parameters())
        step_loop = functools.partial(microbatch_loop, kernels=run.cfg.model.kernels,
                                      backward=optimizer.backward)
        mode_model = prepare(run, model, backend, step_loop=step_loop)
        workspace = mode_model.runtime.arena if mode_model.runtime is not None else None
        optimizer.reserve_staging(_borrow(workspace))
        return cls(run, mode_model, optimizer, Microbatches(run.cfg), workspace)

    @property
    def cfg(self) -> RunConfig:
        return self.run.cfg

    @property
    def plan(self) -> CapturePlan:
        return self.run.plan

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def model(self) -> MHCGPT:
        return self.mode_model.model

    def forward(self, input_ids: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        return self.mode_model(input_ids, seed)

    def release_pending(self) -> int:
        """Release what forwards without a backward still hold (:meth:`ModeModel.release_pending`)."""
        return self.mode_model.release_pending()

    def evaluate(self) -> float:
        """Mean loss over ``train.eval_batches`` held-out batches: ``eval()``, ``no_grad``, no
        dropout. The batches are drawn once, from a generator training never reads."""
        train, dev = self.cfg.train, self.device
        if self._eval_data is None:
            held_out = ProgressionCorpus(self.cfg.model.vocab_size, self.cfg.model.seq_length,
                                         seed=train.seed + 2)
            self._eval_data = [held_out.batch(train.micro_batch_size)
                               for _ in range(train.eval_batches)]
        seed = torch.zeros((), dtype=torch.int64, device=dev)  # unused: dropout is off in eval
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), region("eval"):
                total = sum(lm_loss(self.forward(x.to(dev), seed), y.to(dev),
                                    self.cfg.model.kernels).item()
                            for x, y in self._eval_data)
        finally:
            self.model.train(was_training)
        return total / len(self._eval_data)

    def run_step(self, *, first_microbatch: FirstMicrobatch | None = None,
                 after_backward: Callable[[MHCGPT], None] | None = None) -> StepTensors:
        """One optimizer step over ``num_microbatches``, read back nothing (see
        :class:`StepTensors`).

        The hooks are a tool's, asked for by it: ``first_microbatch(loss)`` runs the first
        microbatch's loss (``loss()``: a probe wraps it); ``after_backward(model)`` runs once
        the gradients are complete, before the optimizer.
        """
        if self.release_pending():
            self.optimizer.zero_grad()  # what the aborted step's backwards accumulated
        if self.mode_model.captures_iteration:
            loss_sum = self._replayed_iteration()
        else:
            loss_sum = microbatch_loop(self.mode_model, lambda index: self.data.next(self.device),
                                       self.cfg.train.num_microbatches,
                                       kernels=self.cfg.model.kernels,
                                       backward=self.optimizer.backward, first=first_microbatch)
        if after_backward is not None:
            after_backward(self.model)
        with region("optimizer"):
            result = self.optimizer.step(_borrow(self.workspace))
        return StepTensors(loss_sum, result.grad_norm, result.found_inf)

    def _replayed_iteration(self) -> torch.Tensor:
        """Every microbatch's forward and backward as one replay (a full-iteration mode):
        the batches are drawn as :func:`microbatch_loop` draws them; returns the summed loss."""
        with region("forward"):
            batches = [self.data.next(self.device) for _ in range(self.cfg.train.num_microbatches)]
        return self.mode_model.run_iteration(batches)

    def step(self, *, first_microbatch: FirstMicrobatch | None = None,
             after_backward: Callable[[MHCGPT], None] | None = None) -> tuple[float, float]:
        """:meth:`run_step`, then its one read back: ``(loss, grad norm)``; ``last_skipped``
        tells whether the optimizer skipped the step (a non-finite gradient)."""
        out = self.run_step(first_microbatch=first_microbatch, after_backward=after_backward)
        norm, self.last_skipped, (loss,) = self.optimizer.finish(
            StepResult(out.grad_norm, out.found_inf), out.loss)
        return loss, norm


def microbatch_loop(model: ModeModel, batch: Callable[[int], Batch], count: int, *,
                    kernels: str, backward: Callable[[torch.Tensor], None],
                    first: FirstMicrobatch | None = None
                    ) -> torch.Tensor:
    """The training step's microbatch loop, written once: the session runs it each step, and a
    full-iteration mode, made with it, captures it over its static batches.

    Each microbatch ``index``'s share of the step's loss, ``model.microbatch_loss`` of
    ``batch(index)`` (drawn in its forward: loading counts with it), then ``backward`` of it, in
    order; returns the summed loss (detached). ``first`` runs the first microbatch's loss (a
    tool's probe). Nothing here holds a microbatch's logits: its backward frees them, as
    it must inside a captured iteration."""
    loss_sum = None
    for index in range(count):
        with region("forward"):
            loss = _microbatch_loss(model, batch(index), kernels, count,
                                    first if index == 0 else None)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        with region("backward"):
            backward(loss)
    return loss_sum


def _microbatch_loss(model: ModeModel, batch: Batch, kernels: str, count: int,
                     run: Callable[[Callable[[], torch.Tensor]], torch.Tensor] | None
                     ) -> torch.Tensor:
    """One microbatch's loss; its batch dies here, before its backward, as nothing reads it."""
    inputs, targets, seed = batch
    del batch

    def loss() -> torch.Tensor:
        return model.microbatch_loss(inputs, targets, seed, kernels, count)

    return loss() if run is None else run(loss)


def _borrow(workspace: Arena | None) -> torch.Tensor | None:
    """All of ``workspace``'s bytes for a temporary that dies before the next forward."""
    return None if workspace is None else workspace.borrow()


@dataclass
class StepTensors:
    """A step's results on the device: the loss summed over microbatches, the gradient norm and
    the skip flag (fp32 scalars)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    found_inf: torch.Tensor


def optimizer_for(cfg: RunConfig, params,
                  reduce_norm: Callable[[torch.Tensor], None] | None = None) -> MainParamAdamW:
    """The training's optimizer over ``params`` (build it before anything captures them);
    ``reduce_norm``: :class:`MainParamAdamW`'s (pipeline ranks sum the norm over ranks)."""
    return MainParamAdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                          model_dtype=TORCH_DTYPES[cfg.train.dtype], reduce_norm=reduce_norm)


def train(run: Run, *, steps: int | None = None, progress: bool = True,
          after_backward: Callable[[int, MHCGPT], None] | None = None,
          first_microbatch: Callable[[int, Callable[[], torch.Tensor]], torch.Tensor] | None = None,
          ) -> TrainResult:
    """Train ``run``'s model on the synthetic corpus for ``steps`` (default ``train.steps``).

    A tool's hooks, each given the step's index: ``after_backward(step, model)`` runs once per
    step before the optimizer (tests read the gradients there, the comparison hashes them);
    ``first_microbatch(step, loss)`` runs each step's first microbatch's loss (``loss()``; a
    memory probe wraps it). Without them a step does what training needs and nothing else.
    """
    steps = run.cfg.train.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"--steps: must be a positive integer, got {steps}")
    session = TrainSession.build(run)
    result = TrainResult(mode=run.mode.name, info=session.mode_model.describe())
    bar = ProgressBar(steps, f"train[{run.mode.name}]", progress)
    for step in range(steps):
        start = time.perf_counter()
        hooks = {"after_backward": None if after_backward is None
                 else functools.partial(after_backward, step),
                 "first_microbatch": None if first_microbatch is None
                 else functools.partial(first_microbatch, step)}
        with region("step"):  # profiler ranges; one name per phase so runs aggregate by name
            loss, grad_norm = session.step(**hooks)
        result.step_times.append(time.perf_counter() - start)
        result.losses.append(loss)
        result.grad_norms.append(grad_norm)
        if session.last_skipped:
            result.skipped_steps.append(step)
        interval = run.cfg.train.eval_interval
        if interval and ((step + 1) % interval == 0 or step + 1 == steps):
            result.eval_steps.append(step + 1)
            result.eval_losses.append(session.evaluate())
        bar.update(step + 1, f"loss {loss:.4f}")
    return result
