"""Runs Megatron-LM snapshots for ``mhc-cg megatron`` and the tests: child processes with the
snapshot first on the path, megatron's training loop, step measurements, CPU shims and
TransformerEngine's graph API on the tape. Not for import by users."""
