"""Errors users see: one clear line per problem, naming the field and what is allowed."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """One or more problems in a configuration; ``problems`` holds one line each."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def did_you_mean(name, allowed) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``allowed`` to ``name``, or an empty string."""
    close = difflib.get_close_matches(str(name), [str(a) for a in allowed], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def is_positive_int(value) -> bool:
    """An ``int`` (not a ``bool``) of at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class StaticRecomputeError(RuntimeError):
    """Misuse of the static-buffer runtime (schedule, shapes, dropout, lifecycle)."""


class GraphCaptureError(RuntimeError):
    """Code inside a capture did something a replayed graph cannot reproduce; ``report`` is the
    capture's :class:`~mhc_cg.graphs.guard.CaptureSafetyReport`, when there is one."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class GraphReplayError(RuntimeError):
    """A replay that would read or write the wrong memory (order, freed storage, no capture)."""


class StaleCaptureError(RuntimeError):
    """A value the captured graphs baked in (dropout, dtype, device, parameter addresses) changed
    after capture; replaying would silently apply the old one."""
