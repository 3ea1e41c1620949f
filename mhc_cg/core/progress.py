"""Progress output for long work, on stderr (stdout carries results)."""

from __future__ import annotations

import sys


class ProgressBar:
    """A one-line progress bar on stderr (silent when ``enabled`` is false)."""

    def __init__(self, total: int, label: str, enabled: bool = True, width: int = 30):
        self.total, self.label, self.enabled, self.width = total, label, enabled, width

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * done // max(self.total, 1)
        line = f"{self.label} [{'#' * filled}{'-' * (self.width - filled)}] {done}/{self.total} {note}"
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{line}" + ("\n" if done >= self.total else ""))
        elif done == 1 or done >= self.total or done % max(self.total // 10, 1) == 0:
            sys.stderr.write(line + "\n")  # logs get a line every 10%, not a carriage-return smear
        sys.stderr.flush()


def log(tool: str, message: str) -> None:
    """``[tool] message`` on stderr, flushed."""
    print(f"[{tool}] {message}", file=sys.stderr, flush=True)
