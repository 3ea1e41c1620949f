"""Layer specs for Megatron-LM's own ``--spec MODULE NAME`` flag (its ``pretrain_gpt.py`` reads the
object ``NAME`` of ``MODULE``): ``--spec megatron_integration.specs mhc_graphed``.

* ``mhc``: the Megatron-LM branch's own ``HyperConnectionTransformerLayer`` (main's assembled by
  :func:`~megatron_integration.layers.main_layer.main_mhc_layer_spec`, which main's core lacks;
  dev's its own ``enable_hyper_connection`` spec), on TE's modules where TransformerEngine is
  installed, else the local ones;
* ``mhc_graphed``: the same layer with ``GraphedSublayerMixin`` (same parameters): the one
  ``mhc_te_graph_helper`` puts on mhc_cg's static runtime.

The branch is the imported ``megatron.core``'s: dev where its local spec takes
``enable_hyper_connection``, else main. Made at import, as ``--spec`` reads plain attributes.
"""

from __future__ import annotations

import inspect

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron_integration.layers.dev_layer import dev_mhc_layer_spec
from megatron_integration.layers.main_layer import main_mhc_layer_spec

DEV = "enable_hyper_connection" in inspect.signature(get_gpt_layer_local_spec).parameters

mhc = dev_mhc_layer_spec() if DEV else main_mhc_layer_spec()
mhc_graphed = dev_mhc_layer_spec(graphed=True) if DEV else main_mhc_layer_spec(graphed=True)
