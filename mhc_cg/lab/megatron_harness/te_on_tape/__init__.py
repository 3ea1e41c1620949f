"""TransformerEngine's graph API for megatron's TE graph helper where TE cannot be imported.

``transformer_engine/`` beside this file is the module tree megatron-core's ``TECudaGraphHelper``
imports; its ``make_graphed_callables`` is TE's own, from TE's wheel
(:mod:`mhc_cg.lab.emulation.te_wheel`), over the tape on a CPU and ``torch.cuda`` graphs on a
GPU; only what needs TE's C extension stands in (the package docstring). It exists so that
megatron's own helper calls TE's own function where TE's package cannot load: ``mhc-cg megatron``
and the tests on a CPU, and the lent GPUs (no TE; its wheel of compiled libraries is 276 MB).
Where TE is installed on a GPU, TE is used.

``load()`` puts it into a process that has imported megatron already, and leaves it off
``sys.path`` (a spawned process, which re-runs the main script, imports megatron without it).

Order matters: megatron's ``extensions/transformer_engine.py`` subclasses TE's modules at import
(``class TELinear(te.pytorch.Linear)``), which the stand-in does not have, and other modules
decide at import whether TE is there (megatron-core 0.16.1's ``attention.py`` then takes
``TELinear`` from the extension). So ``load()`` first imports the modules a GPT model, its
schedules and DDP are made of (``MEGATRON_MODULES``) while no TE is importable, with their
TE-less fallbacks; then it makes ``transformer_engine`` the stand-in and re-imports the one
megatron module that needs it, ``megatron.core.transformer.cuda_graphs`` (whose
``TECudaGraphHelper`` asserts TE's graph support at construction). Modules that bound its
``is_graph_capturing`` at import (DDP's grad hooks, the MoE layer) keep the first copy's flag:
DDP's hooks do not run while a capture computes its grads (``torch.autograd.grad``), and the
models here have no MoE.

CUDA calls the helper makes that a CPU build of torch refuses, each replaced here and nothing
else:

* ``torch.cuda.synchronize`` (megatron-core main's ``_start_capturing`` / ``_finish_capturing``):
  the CPU runs every op synchronously, so waiting for the device is a no-op.

``torch.cuda.current_device`` and ``torch.cuda.empty_cache`` are not touched here: the first is
part of running megatron on the CPU at all (``mhc_cg.lab.megatron_harness.megatron_on_cpu``), the second is
already a no-op without CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_MODULES = ("megatron.core.models.gpt.gpt_model", "megatron.core.models.gpt.gpt_layer_specs",
                    "megatron.core.transformer.attention", "megatron.core.transformer.transformer_block",
                    "megatron.core.distributed", "megatron.core.pipeline_parallel.schedules")


def load_with_modules() -> None:
    """Make ``transformer_engine`` the stand-in with its module classes, and
    ``fast_hadamard_transform`` its torch form, before megatron is imported: megatron's TE
    extension then subclasses the stand-in's modules, and every module that asks whether TE is
    there sees it (``--transformer-impl transformer_engine`` on a CPU)."""
    if any(name == "megatron" or name.startswith("megatron.") for name in sys.modules):
        raise RuntimeError("load the TransformerEngine stand-in with its modules before megatron "
                           "is imported; megatron decides at import whether TE is there")
    # megatron reads te.pytorch.* and te.common.recipe.* off the package as attributes
    _import_standins("transformer_engine", "transformer_engine.pytorch",
                     "transformer_engine.common.recipe", "fast_hadamard_transform")


def _import_standins(*names: str) -> None:
    if HERE not in sys.path and importlib.util.find_spec("transformer_engine") is not None:
        raise RuntimeError("a real TransformerEngine is installed; the stand-in is for machines "
                           "without it")
    # on the path only while the stand-ins are imported: their submodules resolve through the
    # packages from then on, and no process this one spawns (dist-checkpointing's writers re-run
    # the user's script there) finds a transformer_engine megatron was not ordered for
    sys.path.insert(0, HERE)
    try:
        for name in names:
            module = importlib.import_module(name)
            if name == "transformer_engine" and not getattr(module, "STANDIN", False):
                raise RuntimeError(f"transformer_engine resolved to {module.__file__}, a real "
                                   f"TransformerEngine; the stand-in is for machines without it")
    finally:
        sys.path.remove(HERE)


def load() -> None:
    """Make ``transformer_engine`` the stand-in and give megatron's helper its graph API."""
    if "megatron.core" not in sys.modules:
        raise RuntimeError("load the TransformerEngine stand-in after importing megatron.core; "
                           "imported first, it breaks megatron's TE extension classes")
    for name in MEGATRON_MODULES:
        importlib.import_module(name)
    _import_standins("transformer_engine")
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
    from megatron.core import utils
    from megatron.core.transformer import cuda_graphs

    utils._te_version = None  # a version cached while no TE was importable
    importlib.reload(cuda_graphs)
    if not cuda_graphs.HAVE_TE_GRAPHS:
        raise RuntimeError("megatron.core.transformer.cuda_graphs still has no TE graph support "
                           "after loading the stand-in")
