"""Which device a run trains on, and whether the run fits there, decided before anything is allocated."""

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
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if gpus >= pp_size else "cpu"
    if name == "cuda" and gpus < pp_size:
        raise ConfigError(f"train.device: a pipeline of parallel.pp_size={pp_size} ranks on CUDA "
                          f"needs {pp_size} GPUs (one per rank), this machine has {gpus}; "
                          f"use device: cpu")
    return name


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
