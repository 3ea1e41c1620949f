"""``transformer_engine.pytorch.fp8``: TE's FP8 state and autocasts, from its wheel (FP8 stays
off: the stand-in's modules have no FP8 path)."""

from mhc_cg.lab.megatron_harness.te_on_tape.wheel import GRAPH, public

globals().update(public("transformer_engine.pytorch.fp8"))
FP8GlobalStateManager = GRAPH.module.FP8GlobalStateManager  # the one TE's graph code reads
