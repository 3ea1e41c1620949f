"""Which device a run trains on, how many CPU threads it uses there, and whether the run fits,
decided before anything is allocated."""

from __future__ import annotations

import os

import torch

from mhc_cg.config import RunConfig
from mhc_cg.config.choices import DEVICES
from mhc_cg.config.rules import device_fit_problems
from mhc_cg.core.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """``cpu`` or ``cuda``; ``auto`` is CUDA when this torch sees a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' was asked for but this torch build sees no CUDA GPU; "
                          "use 'cpu' or 'auto'")
    if name not in DEVICES:
        raise ConfigError(f"train.device: must be one of {list(DEVICES)}, got {name!r}")
    return torch.device(name)


def resolve_pipeline_device(name: str, pp_size: int) -> str:
    """``cpu`` or ``cuda``; ``auto`` is ``cuda`` only with one GPU per rank (NCCL needs that)."""
    gpus = _visible_gpus()
    if name == "auto":
        return "cuda" if gpus >= pp_size else "cpu"
    if name == "cuda" and gpus < pp_size:
        raise ConfigError(f"train.device: a pipeline of parallel.pp_size={pp_size} ranks on CUDA "
                          f"needs {pp_size} GPUs (one per rank), this machine has {gpus}; "
                          f"use device: cpu")
    return name


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def trains_on_cpu(name: str, pp_size: int = 1) -> bool:
    """Whether a run on ``train.device`` ``name`` with ``pp_size`` ranks trains on the CPU here:
    ``cpu``, or ``auto`` without a GPU for every rank (as :func:`resolve_device` and
    :func:`resolve_pipeline_device` decide)."""
    return name == "cpu" or (name == "auto" and _visible_gpus() < max(pp_size, 1))


# From this hidden size a step's matmuls are large enough for a few threads to pay off.
CPU_THREADED_HIDDEN_SIZE = 1024
CPU_MAX_THREADS = 4


def cpu_threads(hidden_size: int, omp_num_threads: str | None, cores: int) -> int:
    """The threads torch gets for a CPU run: ``OMP_NUM_THREADS`` (``omp_num_threads``) when the
    user set it to a positive integer; else 1 below a hidden size of
    :data:`CPU_THREADED_HIDDEN_SIZE`, and ``min(CPU_MAX_THREADS, cores)`` from there.

    A small model's step is thousands of small ops: handing each to a thread pool costs more than
    the threads save on matrices this small, and torch's default (a thread per core) oversubscribes
    a machine that is busy with anything else (the tiny CPU config trains about ten times faster
    on one thread than on the default on a busy 2-core machine).
    """
    try:
        asked = int(omp_num_threads) if omp_num_threads is not None else 0
    except ValueError:
        asked = 0  # not a count: the rule decides
    if asked >= 1:
        return asked
    if hidden_size < CPU_THREADED_HIDDEN_SIZE:
        return 1
    return max(1, min(CPU_MAX_THREADS, cores))


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def use_cpu_threads(cfg: RunConfig, device: str | None = None) -> bool:
    """On a run that trains on the CPU (``device``: ``train.device`` or its override), set torch's
    threads to :func:`cpu_threads` for this process; a CUDA run keeps torch's default. Returns
    whether it is a CPU run."""
    on_cpu = trains_on_cpu(device or cfg.train.device, cfg.parallel.pp_size)
    if on_cpu:
        torch.set_num_threads(cpu_threads(cfg.model.hidden_size, os.environ.get("OMP_NUM_THREADS"),
                                          _usable_cores()))
    return on_cpu


def device_memory_bytes(device: torch.device) -> int | None:
    """What ``device`` holds in all: the GPU's memory, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(cfg: RunConfig, device: torch.device) -> None:
    """Refuse a run that would not fit ``device`` (:func:`mhc_cg.config.rules.device_fit_problems`)."""
    problems = device_fit_problems(cfg, device_memory_bytes(device), device.type)
    if problems:
        raise ConfigError(problems)
