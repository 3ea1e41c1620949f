"""``transformer_engine.pytorch.graph``: TE's own, from its wheel (see the package docstring)."""

from mhc_cg.lab.megatron_harness.te_on_tape.wheel import GRAPH

make_graphed_callables = GRAPH.module.make_graphed_callables
save_fp8_tensors = GRAPH.module.save_fp8_tensors
restore_fp8_tensors = GRAPH.module.restore_fp8_tensors
set_capture_start = GRAPH.module.set_capture_start
set_capture_end = GRAPH.module.set_capture_end
