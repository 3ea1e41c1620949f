"""Megatron-LM's own training entry (``pretrain_gpt.py``, ``pretrain()``, ``train()``) on a CPU.

``python -m mhc_cg.lab.megatron_harness.entry_on_cpu SCRIPT [MEGATRON FLAGS...]`` runs ``SCRIPT`` (a
user's ``pretrain_gpt.py``, its folder first on the path) as ``__main__`` in one process, over
gloo, after the shims below: rank 0 of 1, or the rank ``RANK`` of ``WORLD_SIZE`` names (one
process per rank, as ``torchrun`` starts them, ``MASTER_PORT`` shared). Megatron's files are run as they are: nothing in them is
edited; a shim replaces a name for this process, each for a reason outside mhc_cg's code (a
CPU build of torch refuses CUDA; Megatron's entry asserts a GPU):

* :func:`mhc_cg.lab.megatron_harness.megatron_on_cpu.install_cpu_shims` (what running megatron-core's
  model on a CPU needs: NVTX ranges, the current device, streams, the CUDA RNG state);
* ``typing.override`` on Python 3.11 (``megatron/training/models/hybrid.py`` imports it; 3.12+);
* a ``TorchFunctionMode`` that puts what asks for ``device="cuda"`` (``pretrain()``'s startup
  timestamps, the loss reductions of ``train_step``), ``Tensor.cuda()`` and ``.to("cuda")`` on
  the CPU, and names a CPU tensor's type as CUDA's (``Tensor.type()``: Megatron's mixed-precision
  optimizer takes only ``torch.cuda.*Tensor`` parameters);
* ``torch.cuda.synchronize`` (Megatron's timers) and ``set_stream`` (a side stream for graph
  capture) no-ops; ``is_current_stream_capturing`` whether a tape capture runs (the pipeline's
  point-to-point sends ask); the memory counters (``training_log``'s memory report) zero; ``empty_cache``
  a no-op;
* ``initialize_megatron`` (``megatron/training/initialize.py``) with ``allow_no_cuda=True``: it
  asserts a GPU otherwise;
* its ``_initialize_distributed`` sees one device (it makes the model-parallel groups only where
  ``torch.cuda.device_count() > 0``) and ``torch.cuda.set_device`` does nothing there;
* its ``_set_random_seed``: afterwards the model-parallel RNG tracker holds an empty state, as
  :func:`mhc_cg.lab.megatron_harness.training.init_ranks` gives it on the CPU (it adds one only on a
  GPU; attention's dropout forks it);
* ``set_jit_fusion_options``: nothing (it warms up the fused kernels on the GPU);
* ``torch.cuda.get_rng_state`` an empty state and ``set_rng_state`` taking one back (a
  checkpoint's RNG state, ``megatron/training/checkpointing.py``'s ``get_rng_state``: a CPU
  build has no CUDA generator, and every draw of the run is the CPU generator's, saved beside);
* dist-checkpointing's write-results queue from a forked process, not a spawned one (a spawned
  process re-runs the user's script without these shims, where Python 3.11's ``typing`` has no
  ``override``);
* with ``--cuda-graph-impl full_iteration``, :mod:`mhc_cg.lab.megatron_harness.full_iteration_on_tape`'s
  shims: ``torch.cuda.CUDAGraph`` and its context manager on the tape, for Megatron's
  ``FullCudaGraphWrapper``;
* where TransformerEngine's package cannot load (every CPU), :mod:`mhc_cg.lab.megatron_harness.te_on_tape`
  is loaded before ``megatron.training``: the module tree Megatron's TE graph helper imports, its
  ``make_graphed_callables`` TE's own from TE's wheel, over the tape.

The CPU runs also pass Megatron's own flags a CPU needs (``examples/megatron/README.md``:
``--use-cpu-initialization``, the fusions off, ``--rerun-mode disabled``, ``--clip-grad 0``).

``MHC_CG_ENTRY_RECORD=FILE`` (the tests): every iteration's losses and gradient norm as
``train_step`` returned them (exact, ``float.hex``), and what mhc_cg's graph helper captured and
replayed, into ``FILE`` as JSON when the script returns.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import typing
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from mhc_cg.lab.pipeline.schedules_on_cpu import names_cuda

RECORD_ENV = "MHC_CG_ENTRY_RECORD"


class CudaOnCpu(TorchFunctionMode):
    """What asks for the CUDA device, on the CPU (a call that names no CUDA device runs as it
    is)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # Megatron's optimizers sort parameters by 'torch.cuda.*Tensor'
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" \
                else name
        if names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to:
            args = tuple("cpu" if names_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _one_device(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        count, set_device = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda device: None)
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = count, set_device
    return run


def _seeded_tracker(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        from megatron.core.tensor_parallel import random as mrandom

        function(*args, **kwargs)
        mrandom.get_cuda_rng_tracker().states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = \
            torch.empty(0, dtype=torch.uint8)
    return run


def install(te_modules: bool = False, full_iteration: bool = False) -> None:
    """Every shim of the module docstring, for the rest of this process; ``te_modules``: the run
    builds TransformerEngine's modules (``--transformer-impl transformer_engine``);
    ``full_iteration``: it captures whole iterations (``--cuda-graph-impl full_iteration``)."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    from mhc_cg.graphs import graph_capturing
    from mhc_cg.graphs.te import te_installed

    if te_modules and not te_installed():
        from mhc_cg.lab.megatron_harness.te_on_tape import load_with_modules

        load_with_modules()
    from mhc_cg.lab.megatron_harness.megatron_on_cpu import install_cpu_shims

    install_cpu_shims()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.set_stream = lambda stream: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(torch.cuda, name, lambda device=None: 0)
    torch.cuda.reset_peak_memory_stats = lambda device=None: None
    torch.cuda.memory_stats = lambda device=None: {}
    torch.cuda.empty_cache = lambda: None
    torch.cuda.is_current_stream_capturing = graph_capturing  # the pipeline's p2p asks
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = _no_cuda_generator
    if not te_installed() and not te_modules:
        from mhc_cg.lab.megatron_harness.te_on_tape import load

        load()
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                     allow_no_cuda=True)
    initialize._initialize_distributed = _one_device(initialize._initialize_distributed)
    initialize._set_random_seed = _seeded_tracker(initialize._set_random_seed)
    training.set_jit_fusion_options = lambda *args, **kwargs: None
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.get_write_results_queue = functools.partial(
        filesystem_async.get_write_results_queue, mp_mode="fork")
    if full_iteration:
        from mhc_cg.lab.megatron_harness.full_iteration_on_tape import install_full_iteration_shims

        install_full_iteration_shims()
    CudaOnCpu().__enter__()  # for the rest of the process


def _no_cuda_generator(state, device="cuda") -> None:
    """A CPU build's CUDA RNG state back from a checkpoint: the empty one saved, nothing else."""
    if state.numel():
        raise ValueError(f"a CUDA RNG state of {state.numel()} bytes from a GPU run's checkpoint: "
                         f"this CPU run has no CUDA generator to give it to; load it on a GPU")


class Record:
    """What the tests read of a run (``MHC_CG_ENTRY_RECORD``): losses, graph counts, the fused
    mHC ops each iteration dispatched, and the bytes per layer each iteration's decoders held
    from their forward to their backward (:class:`~mhc_cg.lab.megatron_harness.step_probe.
    StepProbe`, the first microbatch; ``None`` where no decoder forward ran as Python: a
    full-iteration replay)."""

    def __init__(self) -> None:
        self.losses: list[dict[str, str]] = []
        self.grad_norms: list[str | None] = []
        self.fused_ops: list[int] = []
        self.helpers: list = []
        self.static: dict = {}
        self.saved_bytes_per_layer: list[int | None] = []

    def watch(self) -> None:
        import megatron.training.training as training
        from megatron_integration.capture import te_graph_helper
        from megatron_integration.capture.te_graph_helper import chunk_decoder, model_chunks

        from mhc_cg.lab.emulation.backends import get_backend
        from mhc_cg.lab.megatron_harness.step_probe import FusedOpCounter, StepProbe

        train_step, make = training.train_step, te_graph_helper.make_te_graph_helper

        def recorded_step(*args, **kwargs):
            model = args[2] if len(args) > 2 else kwargs["model"]
            probes = [StepProbe(chunk_decoder(chunk)) for chunk in model_chunks(model)]
            with FusedOpCounter() as fused:
                result = train_step(*args, **kwargs)
            held = [probe.close() for probe in probes]
            layers = sum(len(probe.decoder.layers) for probe in probes)
            self.saved_bytes_per_layer.append(None if None in held else sum(held) // layers)
            self.losses.append({k: float(v).hex() for k, v in result[0].items()})
            norm = result[5]  # train_step's grad_norm
            self.grad_norms.append(None if norm is None else float(norm).hex())
            self.fused_ops.append(sum(fused.calls.values()))
            self.static = static_bytes(model)
            return result

        def recorded_helper(*args, backend=None, **kwargs):
            # on the CPU the recompute graphs capture on the tape
            helper = make(*args, backend=backend or get_backend("tape"), **kwargs)
            self.helpers.append(helper)
            return helper

        training.train_step = recorded_step
        te_graph_helper.make_te_graph_helper = recorded_helper

    def as_json(self) -> dict:
        graphs = [graph for helper in self.helpers
                  for graph in getattr(helper, "mhc_recompute_graphs", {}).values()]
        return {"losses": self.losses, "grad_norms": self.grad_norms, "fused_ops": self.fused_ops,
                "mhc_cg_helpers": len(self.helpers),
                "recompute_graphs": len(graphs),
                "recompute_graph_replays": sum(g.replays for g in graphs),
                "static": self.static, "saved_bytes_per_layer": self.saved_bytes_per_layer,
                **full_iteration_graph()}


def static_bytes(model) -> dict:
    """What mhc_cg's static runtime holds on this rank (the chunks share one arena and one pool
    of persistent sets): bytes, sets, layers; empty where no decoder is on it."""
    from megatron_integration.capture.te_graph_helper import chunk_decoder, model_chunks

    statics = [getattr(chunk_decoder(chunk), "mhc_static", None) for chunk in model_chunks(model)]
    if statics[0] is None:
        return {}
    runtime = statics[0].runtime
    return {"arena_bytes": runtime.arena.nbytes, "slot_sets": runtime.sets.capacity,
            "persistent_set_bytes": runtime.sets.nbytes_per_set,
            "layers": sum(len(static.runtime.layout.layers) for static in statics),
            "block_size": runtime.layout.block_size}


def full_iteration_graph() -> dict:
    """Whether megatron's full-iteration wrapper captured its training graph, and its replays."""
    import sys

    module = sys.modules.get("megatron.core.full_cuda_graph")
    graph = None if module is None else module.FullCudaGraphWrapper.cuda_graph.get("training")
    tape = getattr(graph, "graph", None)
    return {"full_iteration_captured": graph is not None,
            "full_iteration_replays": getattr(tape, "replays", 0)}


def _flag(args: list[str], name: str) -> str | None:
    """The value of Megatron's flag ``name`` in ``args`` (its last), or None."""
    values = [args[i + 1] for i, word in enumerate(args[:-1]) if word == name]
    return values[-1] if values else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m mhc_cg.lab.megatron_harness.entry_on_cpu SCRIPT [FLAGS...]",
              file=sys.stderr)
        return 2
    script = Path(args[0]).resolve()
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    sys.path.insert(0, str(script.parent))
    install(te_modules=_flag(args, "--transformer-impl") == "transformer_engine",
            full_iteration=_flag(args, "--cuda-graph-impl") == "full_iteration")
    if "MASTER_PORT" not in os.environ:
        from mhc_cg.lab.pipeline.driver import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    record = Record() if os.environ.get(RECORD_ENV) else None
    if record is not None:
        record.watch()
    sys.argv = [str(script), *args[1:]]
    runpy.run_path(str(script), run_name="__main__")
    if record is not None:
        Path(os.environ[RECORD_ENV]).write_text(json.dumps(record.as_json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
