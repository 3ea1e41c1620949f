"""The lab: what measures and emulates the product, never imported by it.

The references the product is measured against (the baseline modes and Megatron-LM dev's split:
``references``), the CPU stand-ins for CUDA graphs and TransformerEngine (``emulation``: the tape,
``torch.cuda``'s graph API over a backend, TE's own Python from its wheel), every mode in one
registry and a run resolved once (``registry``, ``resolve``), the pipeline driver over
megatron-core's schedule, and the tools: cost, memory, planning, profiling, compare, benchmarks
and the Megatron harness."""
