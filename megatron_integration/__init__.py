"""megatron-core glue for mhc_cg (config mapping, layer spec, graph helper hook)."""
