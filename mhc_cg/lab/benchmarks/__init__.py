"""Benches and kernel tooling: the step bench (``mhc-cg bench``), the GPU probe (graph pools, fused
kernels, dropout masks), the kernels timed, compiled for sm_90a and run beside their peers
(``mhc-cg kernels``), TF32's error emulated."""
