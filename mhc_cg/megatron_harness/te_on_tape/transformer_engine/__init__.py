"""A stand-in for TransformerEngine, for machines without a GPU.

TransformerEngine cannot be installed without CUDA, yet megatron-core's ``TECudaGraphHelper``
needs it: it imports a handful of names from ``transformer_engine.pytorch`` and calls one of
them, ``make_graphed_callables``. This package has exactly those names; its
``make_graphed_callables`` is mhc_cg's on the ``tape`` backend (the CPU emulation of CUDA
graphs), with TE's argument names. FP8 is refused. Load it with ``mhc_cg.megatron_harness.te_on_tape.load()`` after
megatron is imported; on a GPU real TE is used and
nothing of this package is.
"""

# The newest TE release whose graph API this stand-in covers: ``_order``,
# ``_num_layers_per_chunk`` (2.6) and ``_reuse_graph_input_output_buffers`` (2.7). TE 2.10 adds
# ``reset()`` on each graphed callable, which the stand-in's callables do not have.
__version__ = "2.9.0"

STANDIN = True  # how the loader tells this package from a real TransformerEngine
