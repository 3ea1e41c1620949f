"""``transformer_engine.pytorch.fp8``: TE's FP8 state, from its wheel."""

from mhc_cg.lab.megatron_harness.te_on_tape.wheel import GRAPH

FP8GlobalStateManager = GRAPH.module.FP8GlobalStateManager
