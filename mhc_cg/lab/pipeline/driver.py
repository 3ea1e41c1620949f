"""Pipeline parallelism across processes: ``pp_size`` ranks, ``vpp_size`` model chunks each.

:func:`train_pipeline` spawns one process per pipeline rank (``torch.multiprocessing``; gloo on
CPU, NCCL on GPU) and every rank runs megatron-core's own schedule
(``megatron.core.pipeline_parallel.schedules.get_forward_backward_func``: interleaved 1F1B with
``vpp_size > 1``, plain 1F1B otherwise) with real point-to-point sends and receives of the
residual stream, ``[seq, micro_batch, n * hidden]`` wide. On CPU the schedule runs inside
:func:`mhc_cg.lab.pipeline.schedules_on_cpu.cpu_shim`.

One rank is :class:`mhc_cg.lab.pipeline.rank.PipelineRank`.

Note [a pipeline equals one process] (docs/design.md, item 11). What makes the losses and
gradients equal, bit for bit, to ``pp_size: 1``: each chunk sees
its microbatches first-in first-out in both directions, so every parameter sums its microbatch
gradients in the same order; the loss is megatron's ``(loss * cp_size) / num_microbatches`` with
``cp_size = 1``, the same value and gradient as ``loss / num_microbatches``; AdamW is
element-wise, so each rank's optimizer over its own parameters updates them as one process does.
The gradient norm is each rank's squared norm summed over the ranks, as Megatron does: equal to
one process's up to fp32 rounding (a sum in another order), not bit for bit.
"""

from __future__ import annotations

import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from mhc_cg.config import RunConfig
from mhc_cg.config.rules import pipeline_driver_problems
from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.registry import MODES
from mhc_cg.training.device import resolve_pipeline_device
from mhc_cg.lab.resolve import resolve
from mhc_cg.lab.pipeline.rank import rank_main


# what every CPU rank imports, once, in the fork server
_RANK_IMPORTS = ("mhc_cg.lab.pipeline.rank_imports",)


@dataclass
class PipelineResult:
    """What a pipelined run reports: the last stage's losses and every rank's static buffers.

    ``losses``, ``grad_norms`` and ``step_times`` are per optimizer step, as in
    :class:`mhc_cg.training.session.TrainResult`; ``ranks`` holds one :meth:`RankReport.summary` per rank.
    ``grads`` (only with ``collect_grads``) is, per step, every parameter's gradient by its name
    in the full model, gathered from the ranks that own it.
    """

    mode: str
    pp_size: int
    vpp_size: int
    num_microbatches: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)
    held_bytes_per_microbatch: int | None = None

    @property
    def median_step_ms(self) -> float:
        times = sorted(self.step_times[1:] or self.step_times)
        return 1000.0 * times[len(times) // 2]

    @property
    def info(self) -> dict:
        return {"pp_size": self.pp_size, "vpp_size": self.vpp_size,
                "num_microbatches": self.num_microbatches, "ranks": self.ranks}


# -------------------------------------------------------------------------- the parent
def free_port() -> int:
    """A free TCP port on the loopback interface, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_pipeline(cfg: RunConfig, *, steps: int | None = None, device: str | None = None,
                   progress: bool = True, mode: str | None = None,
                   collect_grads: bool = False) -> PipelineResult:
    """Train ``cfg`` on ``parallel.pp_size`` processes; returns the last stage's losses.

    ``cfg`` must have passed :func:`mhc_cg.config.rules.check`. Raises ``ConfigError`` for what the
    driver does not run (a mode it does not run, :func:`mhc_cg.config.rules.pipeline_driver_problems`).
    """
    import torch.multiprocessing as mp

    pp = cfg.parallel.pp_size
    dev = resolve_pipeline_device(device or cfg.train.device, pp)
    run = resolve(cfg, mode, torch.device(dev))  # each rank resolves it again, in its process
    mode = run.mode.name
    if not run.mode.pipelines:
        runs = [m.name for m in MODES.values() if m.pipelines]
        raise ConfigError(f"--mode: a pipeline (parallel.pp_size={pp}) runs the "
                          f"static-buffer runtime on every rank, mode {' or '.join(runs)}, got "
                          f"{mode!r}; add mhc_recompute to graph.cuda_graph_scope or drop --mode")
    problems = pipeline_driver_problems(cfg)
    if problems:
        raise ConfigError(problems)
    steps = cfg.train.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"--steps: must be a positive integer, got {steps}")
    threads = max(1, torch.get_num_threads() // pp)
    # CPU ranks are forked from a fork server: a fresh single-threaded process that imports
    # megatron-core once (seconds per process otherwise) and forks each rank from there. Forking
    # this process itself is unsafe once it runs other threads (a test runner's worker, a
    # server): a lock one of them holds stays locked in the child. CUDA cannot be forked, so GPU
    # ranks are spawned.
    start_method = "forkserver" if dev == "cpu" else "spawn"
    if dev == "cpu":
        mp.get_context("forkserver").set_forkserver_preload(list(_RANK_IMPORTS))
    with tempfile.TemporaryDirectory(prefix="mhc_cg_pp_") as out_dir:
        mp.start_processes(rank_main, args=(cfg, mode, steps, dev, free_port(), out_dir,
                                             collect_grads, progress, threads),
                           nprocs=pp, join=True, start_method=start_method)
        reports = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                   for r in range(pp)]
    last = reports[-1]
    result = PipelineResult(mode=mode, pp_size=pp, vpp_size=cfg.parallel.vpp_size,
                            num_microbatches=cfg.train.num_microbatches, losses=last.losses,
                            grad_norms=last.grad_norms, step_times=last.step_times,
                            ranks=[r.summary() for r in reports])
    if collect_grads:
        result.grads = [{n: g for r in reports for n, g in r.grads[step].items()}
                        for step in range(steps)]
    return result
