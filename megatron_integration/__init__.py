"""mhc_cg inside Megatron: mHC layers, the static runtime under megatron's TE graph helper.

What a Megatron user imports, from here (each loaded on first use: importing this package
imports nothing from megatron-core):

* ``MHCTransformerConfig``, ``to_transformer_config``: megatron-core's config with the mHC fields,
  and mhc_cg's YAML mapped onto it (``config/``);
* ``get_mhc_layer_spec``, ``MHCTransformerBlock``: mhc_cg's mHC layer as a megatron-core layer
  spec; ``main_mhc_layer_spec`` / ``dev_mhc_layer_spec``: Megatron-LM main's / dev's own
  ``HyperConnectionTransformerLayer`` (``layers/``), ``dev_mhc_block_spec`` dev's decoder of
  dense and MoE layers; ``use_counter_dropout``: dev's mHC dropout drawn from a seed,
  replayable; ``mhc_hybrid_layer``: dev's hybrid-stack mHC layer without its refusal of mHC
  recompute under graphs, for a script to name where the stack builds it;
* ``make_te_graph_helper``: megatron's ``TECudaGraphHelper`` with every decoder on mhc_cg's static
  runtime (every chunk of a rank sharing one arena and one pool of persistent slot sets) and the
  recompute graphs captured along the helper's order; ``mhc_te_graph_helper``, the same called
  as Megatron-LM's ``train()`` calls its helper (``examples/megatron/``);
  ``MHCFullCudaGraphWrapper``: megatron's full-iteration graph wrapper, the decoders on the
  static runtime first (named where ``train()`` looks ``FullCudaGraphWrapper`` up); ``install_rank``,
  ``install_static_recompute`` and ``StaticMHCBlock`` for the parts (``capture/``);
* ``megatron_integration.specs``: the layer specs for Megatron-LM's ``--spec`` flag.

What runs Megatron-LM snapshots in child processes for ``mhc-cg megatron`` and the tests
(training loop, measurements, CPU shims, TransformerEngine's graph API on the tape) lives with
that tool, in :mod:`mhc_cg.lab.megatron_harness`; importing this package loads none of it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "MHCTransformerConfig": "megatron_integration.config.transformer_config",
    "to_transformer_config": "megatron_integration.config.field_map",
    "get_mhc_layer_spec": "megatron_integration.layers.mhc_layer",
    "MHCTransformerBlock": "megatron_integration.layers.mhc_layer",
    "MegatronMHCTransformerLayer": "megatron_integration.layers.mhc_layer",
    "main_mhc_layer_spec": "megatron_integration.layers.main_layer",
    "dev_mhc_layer_spec": "megatron_integration.layers.dev_layer",
    "dev_mhc_block_spec": "megatron_integration.layers.dev_layer",
    "use_counter_dropout": "megatron_integration.layers.counter_dropout",
    "mhc_hybrid_layer": "megatron_integration.layers.hybrid_layer",
    "make_te_graph_helper": "megatron_integration.capture.te_graph_helper",
    "mhc_te_graph_helper": "megatron_integration.capture.te_graph_helper",
    "MHCFullCudaGraphWrapper": "megatron_integration.capture.full_iteration",
    "install_static_recompute": "megatron_integration.capture.install",
    "install_rank": "megatron_integration.capture.install",
    "StaticMHCBlock": "megatron_integration.capture.static_block",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_integration' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
