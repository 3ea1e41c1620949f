"""``transformer_engine.pytorch.utils``: TE's ``make_weak_ref``, from its wheel."""

from mhc_cg.lab.megatron_harness.te_on_tape.wheel import GRAPH

make_weak_ref = GRAPH.module.make_weak_ref
