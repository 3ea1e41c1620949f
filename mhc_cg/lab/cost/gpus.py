"""The GPUs the cost model knows, each figure with where it comes from.

A figure is ``measured`` (on a lent machine of this project, by the means its source names) or
``datasheet`` (NVIDIA's, not checked here). The step model charges bytes at the copy bandwidth
and GEMMs at the dense bf16 rate; the HBM peak is what ``--full-bandwidth`` and the kernels'
Little's-law check use. :func:`gpu_named` maps a device name (``torch.cuda.get_device_name``) to
its row, so a measurement is modelled on the GPU that took it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    value: float
    source: str  # "datasheet: ..." or "measured: ..."


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    names: tuple[str, ...]  # what torch calls it: substrings of the device name
    hbm_bytes_per_s: Figure
    copy_bytes_per_s: Figure  # a device-to-device copy, read plus write
    bf16_flops: Figure  # dense
    tf32_flops: Figure  # dense
    sms: int
    memory_bytes: Figure

    def figures(self) -> dict[str, Figure]:
        return {"HBM bandwidth": self.hbm_bytes_per_s, "copy bandwidth": self.copy_bytes_per_s,
                "dense bf16": self.bf16_flops, "dense TF32": self.tf32_flops,
                "memory": self.memory_bytes}


GPUS: dict[str, GPU] = {gpu.key: gpu for gpu in (
    GPU(key="h100", name="NVIDIA H100 SXM5 80GB", names=("H100 80GB HBM3", "H100 SXM"),
        hbm_bytes_per_s=Figure(3.35e12, "datasheet: HBM3"),
        copy_bytes_per_s=Figure(2.95e12, "measured: 256 MiB copy_, CUDA events, on the H100 runs "
                                         "of b48c0ff and 8b1b9b9 (2960 and 2946 GB/s)"),
        bf16_flops=Figure(989e12, "datasheet"),
        tf32_flops=Figure(494.7e12, "datasheet"),
        sms=132, memory_bytes=Figure(80e9, "datasheet: 80 GB")),
    GPU(key="h200", name="NVIDIA H200 SXM 141GB", names=("H200",),
        hbm_bytes_per_s=Figure(4.8e12, "datasheet: HBM3e"),
        copy_bytes_per_s=Figure(4.3e12, "measured: a device-to-device copy on the lent H200, "
                                        "about 4.3 TB/s read plus write"),
        bf16_flops=Figure(784e12, "measured: torch.matmul 8192^3 bf16 on the lent H200, "
                                  "769-798 TFLOP/s (the midpoint); datasheet 989"),
        tf32_flops=Figure(494.7e12, "datasheet"),
        sms=132, memory_bytes=Figure(141e9, "datasheet: 141 GB (139 GiB seen by torch)")),
)}
DEFAULT_GPU = "h100"


def gpu_named(device_name: str) -> GPU | None:
    """The row of a device name (``NVIDIA H200``, ``NVIDIA H100 80GB HBM3``), or ``None`` for a
    GPU the model does not know (or a CPU)."""
    return next((gpu for gpu in GPUS.values() if any(n in device_name for n in gpu.names)), None)


def name_slug(name: str) -> str:
    """A device name as a file name: ``NVIDIA H200`` -> ``nvidia-h200``, ``cpu`` -> ``cpu``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"
