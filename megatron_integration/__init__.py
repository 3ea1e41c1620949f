"""megatron-core glue for mhc_cg.

* ``transformer_config``: ``MHCTransformerConfig``, a ``TransformerConfig`` with the mHC fields;
* ``mapping``: ``to_transformer_config(RunConfig)``, from mhc_cg's YAML config;
* ``layer``: ``MegatronMHCTransformerLayer`` / ``MHCTransformerBlock`` and ``get_mhc_layer_spec``;
* ``sdpa_attention``: ``SDPACoreAttention``, a core attention that runs on the CPU;
* ``static``: ``StaticMHCBlock``, that block on mhc_cg's static-buffer runtime (recompute graphs);
* ``graphed_layer``: megatron's TE layer graphs as mHC sublayers on the static runtime;
* ``graph_hook``: megatron's ``TECudaGraphHelper`` with the recompute graphs captured along its order;
* ``main_branch``: Megatron-LM ``main``'s own ``HyperConnectionTransformerLayer`` on mhc_cg's block
  recompute and static buffers (needs ``main``'s megatron.core on the path when used);
* ``main_config``, ``main_process``, ``main_runs``: ``main``'s GPT under its TE graph helper, run
  in a child process with ``main``'s megatron first on the path (``mhc-cg megatron``);
* ``megatron_training``: training with megatron-core's ``forward_backward_func``; ``step_probe``:
  what a step holds and replays; ``cpu_shims``: megatron on a CPU build of torch.

Importing this package imports nothing from megatron-core; import the submodules.
"""
