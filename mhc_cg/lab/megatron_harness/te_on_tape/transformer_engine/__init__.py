"""The ``transformer_engine`` Megatron imports where TransformerEngine cannot be: the module tree
its ``TECudaGraphHelper`` reads, each name TE's own where TE's wheel gives it.

TransformerEngine's package cannot be imported here (its ``__init__`` loads TE's CUDA library
and C extension, which neither the CPU machines nor the lent GPUs have), yet megatron-core's
helper imports a handful of names from it and calls one, ``make_graphed_callables``. That one,
and ``save_fp8_tensors``/``restore_fp8_tensors``/``set_capture_start``/``set_capture_end``,
``FP8GlobalStateManager`` and ``make_weak_ref``, are TE's own from its wheel
(:mod:`mhc_cg.lab.emulation.te_wheel`), capturing over ``torch.cuda`` graphs on a GPU and over
the tape on a CPU; ``__version__`` is the wheel's. What the wheel cannot give without TE's C
extension is this package's: the module base class (an ``isinstance`` target: no module here is
a TE module; the same class TE's graph code checks against) and
``is_fp8_activation_recompute_enabled`` (FP8 is off). Load it with
``mhc_cg.lab.megatron_harness.te_on_tape.load()`` after megatron is imported.
"""

from mhc_cg.lab.megatron_harness.te_on_tape.wheel import GRAPH

__version__ = GRAPH.version

STANDIN = True  # how the loader tells this package from an installed TransformerEngine
