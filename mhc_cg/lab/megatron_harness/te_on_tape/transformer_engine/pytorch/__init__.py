"""``transformer_engine.pytorch``: TE's graph API, from its wheel."""

from transformer_engine.pytorch.graph import make_graphed_callables

__all__ = ["make_graphed_callables"]
