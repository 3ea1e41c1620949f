"""``transformer_engine.common``: only its ``recipe`` module is read (TE's own, from the wheel)."""

from transformer_engine.common import recipe  # noqa: F401
