"""GPU cost without a GPU: kernels, bytes and graph-pool memory of every mode's training step.

* :mod:`mhc_cg.cost.ops`: which aten ops launch a kernel, and their bytes (the one definition);
* :mod:`mhc_cg.cost.allocator`: the CUDA caching allocator during capture, emulated;
* :mod:`mhc_cg.cost.op_counters`: op counters and the capture recorder;
* :mod:`mhc_cg.cost.cost_backend`: the recording graph backend (any device, ``meta`` included);
* :mod:`mhc_cg.cost.report`: the per-mode report of ``mhc-cg cost``.
"""

from mhc_cg.cost.ops import launches_kernel, op_bytes

__all__ = ["launches_kernel", "op_bytes"]
