"""Megatron's layers on mhc_cg's static runtime, under megatron's own TE graph helper."""
