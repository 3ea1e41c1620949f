"""megatron-core glue for mhc_cg.

* ``transformer_config``: ``MHCTransformerConfig``, a ``TransformerConfig`` with the mHC fields;
* ``mapping``: ``to_transformer_config(RunConfig)``, from mhc_cg's YAML config;
* ``layer``: ``MegatronMHCTransformerLayer`` / ``MHCTransformerBlock`` and ``get_mhc_layer_spec``;
* ``static``: ``StaticMHCBlock``, that block on mhc_cg's static-buffer runtime (recompute graphs);
* ``graph_hook``: the recompute graphs captured with megatron-core's TE layer graphs;
* ``main_branch``: Megatron-LM ``main``'s own ``HyperConnectionTransformerLayer`` on mhc_cg's block
  recompute and static buffers (needs ``main``'s megatron.core on the path when used).

Importing this package imports nothing from megatron-core; import the submodules.
"""
