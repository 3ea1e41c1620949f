"""megatron-core's ``TransformerConfig`` with the mHC fields, and mhc_cg's YAML mapped onto it."""
