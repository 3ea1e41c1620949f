"""The step model: what one kernel, and so one training step, takes on a modelled GPU.

Note [the step is a band until the kernels are measured]
--------------------------------------------------------
Each kernel takes its bytes at a bandwidth or its FLOPs at the GPU's dense bf16 rate, whichever
is longer; a step adds :data:`EAGER_LAUNCH_S` per eager launch and :data:`GRAPH_LAUNCH_S` per
graph replay, never hidden behind the GPU's work. Bytes go at the copy bandwidth measured on
that GPU (``mhc_cg.lab.cost.gpus``, or the committed copy rows of ``bench/results/``). A fused mHC
kernel is where the model cannot say one figure until the GPU has timed this code's kernels:

1. measured at this kernel source on this GPU, as device time (``mhc-cg kernels --bench``):
   that share of the copy bandwidth, one figure;
2. otherwise a band: **low**, at the copy bandwidth like every other kernel; **high**, at the
   share the probe measured for a kernel of its kind (eager calls timed with CUDA events: host
   and launch cost inside, which a graph replay does not pay), on whichever GPU measured it;
3. no measurement of its kind at all: the copy bandwidth, one figure, and said so.

So every step and overhead is a :class:`Band`; it narrows to one figure when (1) holds for every
fused op. The band is what the model can say, not a bound: the one H100 run measured steps
above its high end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean

from mhc_cg.lab.cost.gpus import DEFAULT_GPU, GPU, GPUS, Figure, gpu_named
from mhc_cg.lab.cost.measured import (FUSED_KINDS, KIND_PROBE, efficiency_rows, is_device_time,
                                  kernel_source_sha256)

EAGER_LAUNCH_S = 4e-6  # host overhead of one eager kernel launch
GRAPH_LAUNCH_S = 8e-6  # one graph replay's launch


@dataclass(frozen=True)
class Band:
    """A modelled time: ``low`` and ``high`` ends (equal when the model knows one figure)."""

    low: float = 0.0
    high: float = 0.0

    def __add__(self, other: "Band | float") -> "Band":
        if isinstance(other, Band):
            return Band(self.low + other.low, self.high + other.high)
        return Band(self.low + other, self.high + other)

    __radd__ = __add__

    def __truediv__(self, other: "Band") -> "Band":
        """End by end: a ratio of two steps modelled under the same assumption."""
        return Band(self.low / other.low, self.high / other.high)

    def scaled(self, factor: float) -> "Band":
        return Band(self.low * factor, self.high * factor)

    def as_dict(self) -> dict[str, float]:
        return {"low": self.low, "high": self.high}

    def format(self, spec: str = ".2f", unit: str = "") -> str:
        low, high = format(self.low, spec), format(self.high, spec)
        return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


@dataclass(frozen=True)
class FusedCharge:
    """A fused op's share of the copy bandwidth at the band's two ends, and why."""

    low: float
    high: float
    source: str


@dataclass(frozen=True)
class StepModel:
    """The GPU, the bandwidth bytes go at, and each fused op's charge (by op schema name)."""

    gpu: GPU
    copy: Figure
    fused: dict[str, FusedCharge] = field(default_factory=dict)

    def kernel_seconds(self, op_name: str, nbytes: int, flops: int) -> tuple[Band, Band]:
        """One kernel's time, split by what bounds it at each end: ``(bandwidth-bound,
        compute-bound)`` (at each end one of the two is zero)."""
        charge = self.fused.get(op_name)
        shares = (charge.low, charge.high) if charge is not None else (1.0, 1.0)
        compute = flops / self.gpu.bf16_flops.value
        moving = [nbytes / (self.copy.value * share) for share in shares]
        return (Band(*(m if m >= compute else 0.0 for m in moving)),
                Band(*(compute if m < compute else 0.0 for m in moving)))

    def step_seconds(self, kernels: Band | int, eager_launches: int, replays: int) -> Band:
        return Band() + kernels + (eager_launches * EAGER_LAUNCH_S + replays * GRAPH_LAUNCH_S)

    def describe(self) -> dict:
        """What the model charges and where each figure comes from (the report's ``gpu``)."""
        return {"key": self.gpu.key, "name": self.gpu.name,
                "figures": {what: {"value": f.value, "source": f.source}
                            for what, f in self.gpu.figures().items()},
                "copy_charged": {"value": self.copy.value, "source": self.copy.source},
                "fused": {op: {"low": c.low, "high": c.high, "source": c.source}
                          for op, c in self.fused.items()},
                "eager_launch_s": EAGER_LAUNCH_S, "graph_launch_s": GRAPH_LAUNCH_S,
                "one_figure": all(c.low == c.high for c in self.fused.values())}


def step_model(gpu: str | None = None, rows: list[dict] | None = None,
               full_bandwidth: bool = False) -> StepModel:
    """The step model of ``gpu`` (a key of :data:`~mhc_cg.lab.cost.gpus.GPUS`) from the committed
    measurements (``rows``: default ``bench/results/kernel_efficiency.json``),
    by Note [the step is a band until the kernels are measured]; ``full_bandwidth``: every kernel
    at the HBM peak instead, one figure."""
    gpu = GPUS[gpu or DEFAULT_GPU]
    if full_bandwidth:
        return StepModel(gpu, Figure(gpu.hbm_bytes_per_s.value,
                                     f"every kernel at the HBM peak ({gpu.hbm_bytes_per_s.source})"))
    rows = efficiency_rows() if rows is None else rows
    return StepModel(gpu, copy_charged(gpu, rows), fused_charges(gpu, rows))


def copy_charged(gpu: GPU, rows: list[dict]) -> Figure:
    """The mean of the committed copy rows measured on ``gpu``, else the table's figure."""
    copies = [r for r in rows if r["class"] == "copy" and gpu_named(r["device"]) is gpu]
    if not copies:
        return gpu.copy_bytes_per_s
    codes = ", ".join(sorted({str(r["code"]) for r in copies}))
    return Figure(mean(r["gb_per_s"] for r in copies) * 1e9,
                  f"measured: the mean of {len(copies)} copy rows on {copies[0]['device']} "
                  f"(code {codes}), bench/results/kernel_efficiency.json")


def fused_charges(gpu: GPU, rows: list[dict]) -> dict[str, FusedCharge]:
    """Per fused op (:data:`~mhc_cg.lab.cost.measured.FUSED_KINDS`), its charge on ``gpu``."""
    fused = [r for r in rows if r["class"] == "fused mHC"]
    current = kernel_source_sha256()
    timed: dict[str, list[dict]] = {}
    for r in fused:
        if is_device_time(r) and r.get("kernel_source_sha256") == current \
                and gpu_named(r["device"]) is gpu:
            timed.setdefault(r["op"], []).append(r)
    eager = {r["kernel"]: r for r in fused if not is_device_time(r)}
    charges = {}
    for op, kind in FUSED_KINDS.items():
        if op in timed:
            own = timed[op]
            share = min(1.0, mean(r["share_of_copy"] for r in own))
            charges[op] = FusedCharge(share, share, f"measured at this code: device time on "
                                      f"{own[0]['device']} ({own[0]['code']})")
        elif KIND_PROBE[kind] in eager:
            r = eager[KIND_PROBE[kind]]
            charges[op] = FusedCharge(1.0, min(1.0, r["share_of_copy"]),
                                      f"unmeasured at this code; the high end is what its kind "
                                      f"({kind}: {r['kernel']}) reached at {r['code']} on "
                                      f"{r['device']}, timed as eager calls (launch included)")
    return charges
