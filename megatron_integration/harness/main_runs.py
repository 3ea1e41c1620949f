"""Megatron-LM main's own mHC GPT under its TE graph helper, on mhc_cg's runtime and beside main's.

Every run trains ``main``'s ``GPTModel`` of ``HyperConnectionTransformerLayer``s from the same
weights, data and update (:mod:`megatron_integration.harness.training`):

* ``main_eager_none``: no recompute, no graphs;
* ``main_eager_mhc``: ``main``'s own ``recompute_modules: [mhc]``, eager;
* ``main_graphed_mhc``: ``[mhc]`` under ``main``'s own ``TECudaGraphHelper`` with
  ``cuda_graph_modules: [attn]``: the attention side's mHC ops run inside the layer graph, where
  no recompute manager reaches them, so ``main`` keeps them (today's silent drop);
* ``mhc_cg``: the same layers with ``GraphedSublayerMixin`` on mhc_cg's static runtime, the layer
  graphs captured by ``main``'s helper (:func:`megatron_integration.capture.te_graph_helper.make_te_graph_helper`)
  and the recompute graphs along its order.

It needs ``main``'s megatron.core first on the path: :mod:`megatron_integration.harness.child_process`
runs it as ``python -m megatron_integration.harness.main_runs SPEC.json OUT.json`` in a child process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from mhc_cg.config import RunConfig
from mhc_cg.core.dtypes import TORCH_DTYPES

from megatron_integration.config.field_map import WARMUP_STEPS, main_config_kwargs
from megatron_integration.harness.training import TrainSetup, train_run, wrap_for_training

RUNS = ("main_eager_none", "main_eager_mhc", "main_graphed_mhc", "mhc_cg")
REFERENCES = ("main_eager_none", "main_eager_mhc")  # what mhc_cg must equal bit for bit


def run_kwargs(kwargs: dict, run: str) -> dict:
    """``main``'s config of one run: the mapped config less what the run leaves out."""
    kwargs = dict(kwargs)
    if run == "main_eager_none":
        for name in ("recompute_granularity", "recompute_modules", "mhc_recompute_layer_num"):
            kwargs.pop(name)
    if run.startswith("main_eager"):
        kwargs.update(cuda_graph_impl="none", cuda_graph_modules=[])
    return kwargs


def main_transformer_config(kwargs: dict):
    """``main``'s ``TransformerConfig`` from :func:`main_config_kwargs`'s plain values."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtypes = {k: TORCH_DTYPES[kwargs[k]] for k in ("params_dtype", "pipeline_dtype")}
    return TransformerConfig(**{**kwargs, **dtypes})


def setup_of(cfg: RunConfig) -> TrainSetup:
    m, t = cfg.model, cfg.train
    return TrainSetup(vocab_size=m.vocab_size, seq_length=m.seq_length,
                      micro_batch_size=t.micro_batch_size, num_microbatches=t.num_microbatches,
                      steps=t.steps, lr=t.lr, seed=t.seed, warmup_steps=WARMUP_STEPS)


def build_run(run: str, cfg: RunConfig, cpu: bool):
    """``(DDP-wrapped GPTModel, TE graph helper or None)`` of one run."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    from megatron_integration.capture.te_graph_helper import make_te_graph_helper
    from megatron_integration.layers.main_layer import main_mhc_layer_spec

    kwargs, recompute_graph = main_config_kwargs(cfg)
    config = main_transformer_config(run_kwargs(kwargs, run))
    setup = setup_of(cfg)
    torch.manual_seed(setup.seed)  # the same weights in every run
    spec = main_mhc_layer_spec(cpu_attention=cpu, graphed=run == "mhc_cg")
    model = GPTModel(config, spec, vocab_size=setup.vocab_size,
                     max_sequence_length=setup.seq_length)
    chunk = wrap_for_training(model if cpu else model.cuda(), config)
    helper = None
    if run == "main_graphed_mhc":
        helper = TECudaGraphHelper([chunk], config, setup.seq_length, setup.micro_batch_size)
    elif run == "mhc_cg":
        helper = make_te_graph_helper([chunk], config, setup.seq_length, setup.micro_batch_size,
                                      recompute_graphs=recompute_graph)
    return chunk, helper


def compare_runs(cfg: RunConfig, runs: list[str], cpu: bool) -> dict:
    """Train each of ``runs``; ``{"runs": {name: measurements}, "bit_identical", "mismatches"}``.

    ``bit_identical`` holds when every step's loss and every gradient byte of ``mhc_cg`` equal
    those of each reference run present (``None`` when there is nothing to compare).
    """
    from megatron_integration.harness.training import use_microbatches

    use_microbatches(setup_of(cfg))
    results = {}
    for run in runs:
        chunk, helper = build_run(run, cfg, cpu)
        results[run] = train_run(run, chunk, setup_of(cfg), helper=helper, cpu=cpu)
    mismatches = []
    references = [r for r in REFERENCES if r in results]
    if "mhc_cg" in results:
        ours = results["mhc_cg"]
        for ref in references:
            for key in ("losses", "grad_digests"):
                steps = [i + 1 for i, (a, b) in enumerate(zip(ours[key], results[ref][key])) if a != b]
                if steps:
                    mismatches.append(f"mhc_cg {key} differ from {ref} at steps {steps}")
    identical = None if not references or "mhc_cg" not in results else not mismatches
    return {"runs": results, "bit_identical": identical, "mismatches": mismatches}


def child_main(argv: list[str]) -> None:
    """``SPEC.json OUT.json``: ``{"config": RunConfig as a dict, "runs": [...], "device": ...}``."""
    spec = json.loads(Path(argv[0]).read_text())
    cpu = spec["device"] != "cuda"
    if cpu:
        from megatron_integration.harness.megatron_on_cpu import install_cpu_shims

        install_cpu_shims()
    import megatron.core  # noqa: F401  (before TransformerEngine's stand-in, see main_process)

    from megatron_integration.harness.child_process import STANDIN_ENV, load_te_standin
    from megatron_integration.harness.training import init_single_process

    if os.environ.get(STANDIN_ENV):
        load_te_standin(os.environ[STANDIN_ENV])

    cfg = RunConfig.from_dict(spec["config"])
    init_single_process(cpu, cfg.train.seed)
    result = compare_runs(cfg, spec["runs"], cpu)
    result["megatron_core"] = megatron.core.__file__
    Path(argv[1]).write_text(json.dumps(result))


if __name__ == "__main__":
    child_main(sys.argv[1:])
