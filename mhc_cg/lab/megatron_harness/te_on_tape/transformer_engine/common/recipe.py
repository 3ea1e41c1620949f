"""``transformer_engine.common.recipe``: TE's own recipes, from its wheel."""

from mhc_cg.lab.megatron_harness.te_on_tape.wheel import public

globals().update(public("transformer_engine.common.recipe"))
