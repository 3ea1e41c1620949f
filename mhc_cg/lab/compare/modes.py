"""``mhc-cg train --compare``: the same steps in every mode, side by side.

Modes: every registered mode that trains the configured model (:mod:`mhc_cg.lab.registry`),
against the reference, ``eager_none``. Same weights, same data, same dropout seeds; the losses,
every gradient of every step (hashed by the comparison's own hooks into each step,
:class:`mhc_cg.lab.compare.watch.StepWatch`) and the evaluation losses must agree bit for bit, and
every loss must be finite (:func:`mismatches`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mhc_cg.lab.compare.watch import StepWatch
from mhc_cg.config import RunConfig
from mhc_cg.lab.registry import MODES, REFERENCE
from mhc_cg.training.device import resolve_device
from mhc_cg.lab.resolve import refusal
from mhc_cg.training.session import TrainResult
from mhc_cg.lab.resolve import train_config


@dataclass
class Compared(TrainResult):
    """One mode's run as the comparison saw it: what training returned, and what its hooks
    watched (:class:`StepWatch`)."""

    grad_digests: list[str] = field(default_factory=list)  # per step: every gradient's bytes
    held_bytes_per_microbatch: int | None = None  # allocated by a forward and held until backward


def compared_modes() -> tuple[str, ...]:
    """The modes ``--compare`` runs: every registered mode that trains the configured model."""
    return tuple(mode.name for mode in MODES.values() if mode.same_model)


def refused_modes(cfg: RunConfig, device: str | None = None,
                  modes: tuple[str, ...] | None = None) -> dict[str, str]:
    """``{mode: why}`` for the compared modes that cannot train ``cfg`` (one line each)."""
    dev = resolve_device(device or cfg.train.device).type
    reasons = {mode: refusal(cfg, mode, dev) for mode in (modes or compared_modes())}
    return {mode: why for mode, why in reasons.items() if why is not None}


def run_modes(cfg: RunConfig, *, steps: int | None = None, device: str | None = None,
              progress: bool = True, modes: tuple[str, ...] | None = None,
              refused: dict[str, str] | None = None) -> dict[str, Compared]:
    """Every compared mode that can train ``cfg``: not those of ``refused`` (default:
    :func:`refused_modes`), each watched (:class:`StepWatch`)."""
    refused = refused_modes(cfg, device, modes) if refused is None else refused
    return {mode: run_watched(cfg, mode, steps=steps, device=device, progress=progress)
            for mode in (modes or compared_modes()) if mode not in refused}


def run_watched(cfg: RunConfig, mode: str, *, steps: int | None = None,
                device: str | None = None, progress: bool = False) -> Compared:
    """``mode`` trained on ``cfg`` with the comparison's hooks in every step."""
    watch = StepWatch(resolve_device(device or cfg.train.device))
    result = train_config(cfg, steps=steps, device=device, progress=progress, mode=mode,
                   after_backward=watch.after_backward, first_microbatch=watch.first_microbatch)
    return Compared(**vars(result), grad_digests=watch.grad_digests,
                    held_bytes_per_microbatch=watch.held_bytes_per_microbatch)


def _all_finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def mismatches(results: dict[str, Compared]) -> list[str]:
    """Why the modes disagree with the reference (or are not finite), one line each; empty when
    every loss is finite and losses, gradients and evaluation losses are bit-identical."""
    reference = results.get(REFERENCE)
    problems = []
    for mode, r in results.items():
        if not _all_finite(r.losses) or not _all_finite(r.eval_losses):
            problems.append(f"{mode}: a loss is not finite")
        if reference is None or r is reference:
            continue
        for name in ("losses", "grad_digests", "eval_losses"):
            if getattr(r, name) != getattr(reference, name):
                what = "gradients" if name == "grad_digests" else name.replace("_", " ")
                problems.append(f"{mode}: {what} differ from {REFERENCE}'s")
    return problems


def to_json(results: dict[str, Compared]) -> dict:
    reference = results.get(REFERENCE)
    modes = {}
    for mode, r in results.items():
        modes[mode] = {
            "losses": r.losses,
            "grad_norms": r.grad_norms,
            "eval_steps": r.eval_steps,
            "eval_losses": r.eval_losses,
            "skipped_steps": r.skipped_steps,
            "losses_equal_eager_none": None if reference is None else r.losses == reference.losses,
            "grads_equal_eager_none": None if reference is None
            else r.grad_digests == reference.grad_digests,
            "eval_losses_equal_eager_none": None if reference is None
            else r.eval_losses == reference.eval_losses,
            "grad_norms_equal_eager_none": None if reference is None
            else r.grad_norms == reference.grad_norms,
            "held_bytes_per_microbatch": r.held_bytes_per_microbatch,
            "step_ms_median": r.median_step_ms,
            **r.info,
        }
    return {"modes": modes, "agree": not mismatches(results), "mismatches": mismatches(results)}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.2f} MiB"


# under the table: what a step's time includes here
STEP_NOTE = ("step ms: median wall time of a step, with the comparison's hash of every gradient "
             "(copied to the host) in it")
# under the table of a CPU run: its step times are the host's, with graphs emulated by the tape
CPU_STEP_NOTE = ("step ms (CPU host): median wall time of a step on this CPU, graphs on the tape, "
                 "with the comparison's hash of every gradient in it; says nothing about a GPU's "
                 "step time (mhc-cg bench measures that)")


def format_table(results: dict[str, Compared], *, cpu: bool = False) -> str:
    """One row per mode; ``cpu``: the runs trained on the CPU, which the step column says."""
    reference = results.get(REFERENCE)
    header = ("mode", "loss first -> last", "loss == eager_none", "held / microbatch", "arena", "persistent / mb",
              "graphs", "step ms (CPU host)" if cpu else "step ms")
    rows = []
    for mode, r in results.items():
        if not _all_finite(r.losses):
            same = "not finite"  # NaN != NaN: a difference would read as 0
        elif reference is None or mode == REFERENCE:
            same = "(reference)"
        elif not _all_finite(reference.losses):
            same = "reference not finite"
        else:
            worst = max(abs(a - b) for a, b in zip(r.losses, reference.losses))
            same = "bit-identical" if r.losses == reference.losses else f"max diff {worst:.3g}"
            if r.losses == reference.losses and r.grad_digests != reference.grad_digests:
                same = "losses equal, grads differ"
        rows.append((mode, f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}", same, _mib(r.held_bytes_per_microbatch),
                     _mib(r.info.get("arena_bytes")), _mib(r.info.get("persistent_bytes_per_microbatch")),
                     str(r.info.get("graphs", 0)), f"{r.median_step_ms:.1f}"))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [CPU_STEP_NOTE if cpu else STEP_NOTE])
