"""Profiling and timelines: phase profiles of a step, nsys / torch.profiler exports aggregated by
range name (``mhc-cg timeline``)."""
