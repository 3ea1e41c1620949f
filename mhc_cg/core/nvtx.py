"""The profilers' half of a region (:func:`mhc_cg.core.regions.region`, the one way to name
work): NVTX for nsys, ``record_function`` for torch.profiler, under one name::

    nvtx_range("fwd", chunk, microbatch, layer)   # -> "fwd/0/3/5"

Names are ``{kind}/{chunk}/{microbatch}/{layer}``; trailing parts may be left out
(``nvtx_range("step")`` is ``"step"``); a missing part before a given one is written ``-``.
``mhc-cg timeline`` aggregates by exactly this name, so the same work must get the same name in
the runs being compared.

Cost when off (``MHC_CG_NVTX=0`` in the environment, or ``enable(False)``): one function call that
returns a shared no-op context manager; the name is never formatted. When on, NVTX ranges go to
the ``mhc_cg`` domain with the ``nvtx`` PyPI package (which works with or without a GPU and is a
no-op unless a tool such as nsys is attached); a ``torch.profiler.record_function`` range is
added only while a torch profiler is recording, so CPU Chrome traces carry the same names.
``MHC_CG_RECORD_FUNCTION=0`` / ``enable(record_function=False)`` turns that second part off.

Ranges are per thread: enter and exit on the same thread (NVTX push/pop keeps a per-thread stack).
"""

from __future__ import annotations

import os

import torch


try:
    import nvtx as _nvtx
except ImportError:  # a declared dependency; without it only the torch.profiler half works
    _nvtx = None

DOMAIN = "mhc_cg"
_PHASE_COLORS = {"fwd": 0xFF4C72B0, "bwd": 0xFFDD8452, "recompute": 0xFFC44E52, "eager": 0xFF55A868}
_OTHER_COLOR = 0xFF8C8C8C


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no", "")


_nvtx_on: bool = _env_flag("MHC_CG_NVTX")
_record_function_on: bool = _nvtx_on and _env_flag("MHC_CG_RECORD_FUNCTION")
_profiler_enabled = torch._C._autograd._profiler_enabled  # C call; true only while a profiler records
# made at import, while nothing runs: nvtx decides at creation whether a tool is attached (one is
# attached when the process starts), and the domain keeps the strings it registered
_domain = _nvtx.get_domain(DOMAIN) if _nvtx is not None else None
# a memo, name -> EventAttributes: the domain registers a string each time it is asked for one
_attributes: dict[str, object] = {}


class _NoRange:
    """The shared do-nothing context manager handed out while ranges are off."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


NO_RANGE = _NoRange()


def range_name(phase: str, chunk: int | None = None, microbatch: int | None = None,
               layer: int | str | None = None) -> str:
    """``{phase}/{chunk}/{microbatch}/{layer}``, trailing ``None`` parts dropped, inner ones ``-``."""
    parts = [phase, chunk, microbatch, layer]
    while parts[-1] is None:
        parts.pop()
    return "/".join("-" if p is None else str(p) for p in parts)


class _Range:
    """An enabled range: an NVTX push/pop and, if a torch profiler records, a record_function."""

    __slots__ = ("name", "_record", "_pushed")

    def __init__(self, name: str):
        self.name = name
        self._record = None
        self._pushed = None  # the nvtx domain pushed on, so exit pops exactly what enter pushed

    def __enter__(self) -> "_Range":
        if _nvtx_on and _domain is not None:
            attributes = _attributes.get(self.name)
            if attributes is None:
                phase = self.name.split("/", 1)[0]
                attributes = _attributes[self.name] = _domain.get_event_attributes(
                    message=self.name, color=_PHASE_COLORS.get(phase, _OTHER_COLOR))
            _domain.push_range(attributes)
            self._pushed = _domain
        if _record_function_on and _profiler_enabled():
            self._record = torch.autograd.profiler.record_function(self.name)
            self._record.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._record is not None:
            self._record.__exit__(None, None, None)
            self._record = None
        if self._pushed is not None:
            self._pushed.pop_range()
            self._pushed = None


def nvtx_range(phase: str, chunk: int | None = None, microbatch: int | None = None,
               layer: int | str | None = None):
    """A context manager timing one graph or eager segment under ``{phase}/{chunk}/{microbatch}/{layer}``.

    Off: returns :data:`NO_RANGE` without touching the arguments. A range closes exactly what it
    opened, so switching off while a range is open leaves both profilers' stacks balanced.
    """
    if not (_nvtx_on or _record_function_on):
        return NO_RANGE
    return _Range(range_name(phase, chunk, microbatch, layer))


def enable(on: bool = True, *, record_function: bool | None = None) -> None:
    """Switch ranges on or off for the whole process.

    ``on`` switches the NVTX half and, unless ``record_function`` is given, the torch.profiler
    half with it; ``record_function=False`` keeps NVTX ranges but stops adding profiler ranges.
    """
    global _nvtx_on, _record_function_on
    _nvtx_on = bool(on)
    _record_function_on = bool(on) if record_function is None else bool(record_function)


def profiler_recording() -> bool:
    """True while a torch profiler (torch.profiler or torch.autograd.profiler) is recording.

    Code that would open its own profiler (a memory probe, say) must not while this is true: on
    torch 2.13 an inner profiler's exit ends the outer session, and exporting the outer trace then
    crashes the process.
    """
    return bool(_profiler_enabled())


def enabled_parts() -> dict[str, bool]:
    """Which halves are on: ``{"nvtx": ..., "record_function": ...}``."""
    return {"nvtx": _nvtx_on, "record_function": _record_function_on}
