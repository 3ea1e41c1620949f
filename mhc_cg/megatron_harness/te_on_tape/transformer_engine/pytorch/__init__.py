"""``transformer_engine.pytorch`` of the stand-in: the graph API megatron-core's helper calls."""

from transformer_engine.pytorch.graph import make_graphed_callables

__all__ = ["make_graphed_callables"]
