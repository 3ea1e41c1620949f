"""GPU cost without a GPU: kernels, bytes and graph-pool memory of every mode's training step.

* :mod:`mhc_cg.lab.cost.ops`: which aten ops launch a kernel, and their bytes (the one definition);
* :mod:`mhc_cg.lab.cost.allocator`: the CUDA caching allocator during capture, emulated;
* :mod:`mhc_cg.lab.cost.op_counters`: op counters and the capture recorder;
* :mod:`mhc_cg.lab.cost.cost_backend`: the recording graph backend (any device, ``meta`` included);
* :mod:`mhc_cg.lab.cost.report`: the per-mode report of ``mhc-cg cost``;
* :mod:`mhc_cg.lab.cost.gpus`: the GPUs the step model knows (torch-free: ``--help`` reads it).
"""
