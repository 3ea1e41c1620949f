"""Megatron-LM's own mHC GPT (``main`` or ``dev``) under its TE graph helper, on mhc_cg's runtime
and beside Megatron's own runs; one process per rank.

Every run trains the branch's ``GPTModel`` of ``HyperConnectionTransformerLayer``s from the same
weights, data and update (:mod:`mhc_cg.lab.megatron_harness.training`), ``{branch}`` being
``main`` or ``dev``:

* ``{branch}_eager_none``: no recompute, no graphs;
* ``{branch}_eager_mhc``: Megatron's own ``recompute_modules: [mhc]``, eager;
* ``{branch}_graphed_mhc``: ``[mhc]`` under Megatron's own ``TECudaGraphHelper`` with
  ``cuda_graph_modules: [attn]`` (``main``: the attention side's mHC ops run inside the layer
  graph, where no recompute manager reaches them; ``dev``: its attention-only split with
  ``MHCRecomputeArena``). Where the branch's config refuses it (``dev`` with VPP), the run is
  recorded as refused, with Megatron's message;
* ``mhc_cg``: the same layers with ``GraphedSublayerMixin`` on mhc_cg's static runtime (Megatron's
  own mHC recompute off), the layer graphs captured by Megatron's helper
  (:func:`megatron_integration.capture.te_graph_helper.make_te_graph_helper`) and the recompute
  graphs along the same order.

With ``megatron.use_fused_mhc`` the layers' mHC runs on mhc_cg's fused kernels, whose rounding is
not Megatron's: the runs are ``{branch}_eager_none`` (Megatron's native ops, the figure to be
close to), ``mhc_cg_fused_eager`` (the fused kernels, eager, no recompute:
:mod:`mhc_cg.lab.megatron_harness.fused_eager`) and ``mhc_cg`` (or ``mhc_cg_full_iteration``),
which must equal ``mhc_cg_fused_eager`` bit for bit.

With ``megatron.cuda_graph_impl: full_iteration`` (``dev`` only) the runs are, every one
trained through dev's own ``FullCudaGraphWrapper`` but the references
(:func:`mhc_cg.lab.megatron_harness.training.train_run`; on the CPU the wrapper's CUDA graph is
the tape, :mod:`mhc_cg.lab.megatron_harness.full_iteration_on_tape`):

* ``dev_eager_none``: the reference, no recompute, no graph, at the config's dropout;
* ``dev_eager_none_dropout0``: the same at ``hidden_dropout`` 0, the reference of dev's own run
  (only when the config's dropout is above 0);
* ``dev_full_iteration_mhc``: dev's ``cuda_graph_impl: full_iteration`` with its own
  ``recompute_modules: [mhc]``, at ``hidden_dropout`` 0 (dev refuses mHC recompute under a
  full-iteration graph with dropout); where dev's config refuses it (VPP), recorded as refused;
* ``mhc_cg_full_iteration``: dev's layers (no layer graphs) on mhc_cg's static runtime, its block
  recompute eager inside the one graph, at the config's (counter) dropout.

The branch's megatron.core must be first on the path:
:mod:`mhc_cg.lab.megatron_harness.child_process` starts ``tp x pp`` processes of
``python -m mhc_cg.lab.megatron_harness.runs SPEC.json OUT_DIR RANK WORLD PORT``, and each
writes ``OUT_DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

from mhc_cg.config import RunConfig
from mhc_cg.config.rules import FULL_ITERATION
from mhc_cg.core.dtypes import TORCH_DTYPES

from megatron_integration.config.field_map import WARMUP_STEPS, megatron_config_kwargs
from mhc_cg.lab.megatron_harness.training import TrainSetup, train_run, wrap_for_training
from mhc_cg.lab.emulation.backends import get_backend

BRANCHES = ("main", "dev", "core")
OURS = "mhc_cg"
DEV_FULL = "dev_full_iteration_mhc"
OURS_FULL = "mhc_cg_full_iteration"
NO_DROPOUT = "dev_eager_none_dropout0"
FUSED_EAGER = "mhc_cg_fused_eager"
# what each run under dev's FullCudaGraphWrapper is trained as: dev's own [mhc] recompute
# (dropout 0), or mhc_cg's static runtime
_FULL_ITERATION_RUNS = (DEV_FULL, OURS_FULL)
# Megatron's own mHC recompute; the block size is also the static runtime's
_MEGATRON_RECOMPUTE = ("recompute_granularity", "recompute_modules")
_RECOMPUTE_FIELDS = (*_MEGATRON_RECOMPUTE, "mhc_recompute_layer_num")


def runs_of(branch: str, impl: str = "transformer_engine", dropout: float = 0.0,
            fused: bool = False) -> tuple[str, ...]:
    """Every run of a comparison on ``branch``, references first; ``impl``: the config's
    ``megatron.cuda_graph_impl``, ``dropout`` its ``model.hidden_dropout``, ``fused`` its
    ``megatron.use_fused_mhc``."""
    if fused:
        return (f"{branch}_eager_none", FUSED_EAGER, ours(impl))
    if impl == FULL_ITERATION:
        return ("dev_eager_none", *((NO_DROPOUT,) if dropout > 0 else ()), DEV_FULL, OURS_FULL)
    if branch == "core":
        return ("core_eager_none", "core_eager_block", OURS)
    return (f"{branch}_eager_none", f"{branch}_eager_mhc", f"{branch}_graphed_mhc", OURS)


def ours(impl: str = "transformer_engine") -> str:
    """mhc_cg's run of a comparison (the one ``mhc-cg megatron`` trains without ``--compare``)."""
    return OURS_FULL if impl == FULL_ITERATION else OURS


def checked_runs(branch: str, impl: str = "transformer_engine", dropout: float = 0.0,
                 fused: bool = False) -> dict[str, tuple[str, ...]]:
    """``{run: the runs it must equal bit for bit}``: ``mhc_cg`` and the branch's
    :func:`references`; under ``full_iteration`` both graphed runs, each against dev without
    recompute at its own dropout; with ``fused``, mhc_cg's run against its fused eager run."""
    if fused:
        return {ours(impl): (FUSED_EAGER,)}
    if impl == FULL_ITERATION:
        return {DEV_FULL: (NO_DROPOUT if dropout > 0 else "dev_eager_none",),
                OURS_FULL: ("dev_eager_none",)}
    return {OURS: references(branch)}


def references(branch: str) -> tuple[str, ...]:
    """The runs ``mhc_cg`` must equal bit for bit: the eager runs whose recompute is exact
    (``main``'s ``[mhc]``, mhc_cg's eager block recompute on megatron-core); ``dev``'s run
    without recompute."""
    if branch == "dev":
        return ("dev_eager_none",)
    return runs_of(branch)[:2]


def run_kwargs(kwargs: dict, run: str, branch: str) -> dict:
    """The branch's config of one run: the mapped config less what the run leaves out."""
    kwargs = dict(kwargs)
    if run == NO_DROPOUT or run == DEV_FULL:  # dev: no dropout with [mhc] under full_iteration
        kwargs["hidden_dropout"] = 0.0
    if run in _FULL_ITERATION_RUNS:
        if run == OURS_FULL:  # the runtime recomputes, in blocks of mhc_recompute_layer_num
            for name in _MEGATRON_RECOMPUTE:
                kwargs.pop(name)
        kwargs.update(cuda_graph_impl=FULL_ITERATION, cuda_graph_modules=[])
        return kwargs
    if run.endswith("_eager_none") or run in (NO_DROPOUT, FUSED_EAGER):
        for name in _RECOMPUTE_FIELDS:
            kwargs.pop(name)
    elif run in (OURS, FUSED_EAGER) and branch == "dev":
        # dev's own mHC recompute off: the runtime recomputes, in blocks of
        # mhc_recompute_layer_num layers (and dev refuses [mhc] with layer graphs beyond its
        # attention split)
        for name in _MEGATRON_RECOMPUTE:
            kwargs.pop(name)
    if "_eager" in run:
        kwargs.update(cuda_graph_impl="none", cuda_graph_modules=[])
    return kwargs


def transformer_config(kwargs: dict):
    """The branch's ``TransformerConfig`` from :func:`megatron_config_kwargs`'s plain values."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtypes = {k: TORCH_DTYPES[kwargs[k]] for k in ("params_dtype", "pipeline_dtype")}
    return TransformerConfig(**{**kwargs, **dtypes})


def setup_of(cfg: RunConfig) -> TrainSetup:
    m, t = cfg.model, cfg.train
    # under full_iteration every run of the comparison takes its counter-dropout seeds from the
    # batches: an input the graph reads (a draw at capture would be replayed forever)
    seeds = cfg.megatron.cuda_graph_impl == FULL_ITERATION and m.dropout_impl == "counter"
    return TrainSetup(vocab_size=m.vocab_size, seq_length=m.seq_length,
                      micro_batch_size=t.micro_batch_size, num_microbatches=t.num_microbatches,
                      steps=t.steps, lr=t.lr, seed=t.seed, warmup_steps=WARMUP_STEPS,
                      dropout_seeds=seeds)


def decoder_spec(branch: str, config, vp_stage: int | None, *, cpu: bool, graphed: bool):
    """The GPT's layer (``main``) or block (``dev``) spec for one model chunk."""
    if branch == "dev":  # dense and MoE layers as dev's moe_layer_freq places them
        from megatron_integration.layers.dev_layer import dev_mhc_block_spec

        return dev_mhc_block_spec(config, vp_stage, cpu=cpu, graphed=graphed)
    from megatron_integration.layers.main_layer import main_mhc_layer_spec

    return main_mhc_layer_spec(cpu_attention=cpu, graphed=graphed)


def core_config(run: str, cfg: RunConfig):
    """megatron-core's ``MHCTransformerConfig`` of one run with mhc_cg's own layer: no recompute,
    mhc_cg's eager block recompute, or the static runtime under megatron's helper."""
    from megatron_integration.config.field_map import to_transformer_config

    overrides = {}
    if run == "core_eager_none":
        overrides["mhc_recompute_layer_num"] = None
    if run != OURS:
        overrides.update(cuda_graph_impl="none", cuda_graph_scope=[])
    return to_transformer_config(cfg, **overrides)


def core_chunk(config, cfg: RunConfig, stage: int | None):
    """megatron-core's ``GPTModel`` with mhc_cg's layer and block (``MHCTransformerBlock``
    replaces the plain decoder GPTModel builds, for the stream boundaries) for one chunk; the
    layer is graphable as it is (``GraphedSublayerMixin`` is in its bases)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_integration.layers.cpu_norm import block_spec_on_cpu
    from megatron_integration.layers.mhc_layer import MHCTransformerBlock, get_mhc_layer_spec

    where = dict(ignore_virtual=False, vp_stage=stage) if stage is not None else {}
    stage_kwargs = {"vp_stage": stage} if stage is not None else {}
    pre = parallel_state.is_pipeline_first_stage(**where)
    post = parallel_state.is_pipeline_last_stage(**where)
    cpu = cfg.train.device != "cuda"
    spec = get_mhc_layer_spec(cpu_attention=cpu)
    block = block_spec_on_cpu(spec, config, stage) if cpu else spec
    model = GPTModel(config, block, vocab_size=cfg.model.vocab_size,
                     max_sequence_length=cfg.model.seq_length, pre_process=pre,
                     post_process=post, **stage_kwargs)
    model.decoder = MHCTransformerBlock(config, block, pre_process=pre, post_process=post,
                                        **stage_kwargs)
    return model


def schedule_config(config, num_streams: int):
    """The config megatron-core 0.16.1's schedules read (the DDP wrapper's): its receive and
    send buffers are ``hidden_size`` wide, and between stages the residual stream is n-fold (that
    release knows no mHC; dev sizes them itself)."""
    view = copy.copy(config)
    view.hidden_size = config.hidden_size * num_streams
    return view


def build_run(run: str, cfg: RunConfig, branch: str, cpu: bool):
    """``(this rank's DDP-wrapped model chunks, TE graph helper or None)`` of one run;
    ``ValueError`` where the branch's config refuses the run."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    from megatron_integration.capture.te_graph_helper import make_te_graph_helper

    if branch == "core":
        config = core_config(run, cfg)
    else:
        config = transformer_config(run_kwargs(megatron_config_kwargs(cfg, branch)[0], run, branch))
    if torch.distributed.get_world_size() > 1:
        config.finalize_model_grads_func = finalize_model_grads  # TP and embedding all-reduces
    setup = setup_of(cfg)
    vpp = cfg.parallel.vpp_size
    torch.manual_seed(setup.seed)  # the same weights in every run
    chunks = []
    for stage in range(vpp):
        if branch == "core":
            model = core_chunk(config, cfg, stage if vpp > 1 else None)
        else:
            where = dict(ignore_virtual=False, vp_stage=stage) if vpp > 1 else {}
            spec = decoder_spec(branch, config, stage if vpp > 1 else None, cpu=cpu,
                                graphed=run == OURS)
            model = GPTModel(config, spec, vocab_size=setup.vocab_size,
                             max_sequence_length=setup.seq_length,
                             pre_process=parallel_state.is_pipeline_first_stage(**where),
                             post_process=parallel_state.is_pipeline_last_stage(**where),
                             **({"vp_stage": stage} if vpp > 1 else {}))
        chunk = wrap_for_training(model if cpu else model.cuda(), config)
        if branch == "core" and cfg.parallel.pp_size > 1:
            chunk.config = schedule_config(config, cfg.model.num_streams)
        chunks.append(chunk)
    if branch != "core" and cfg.model.dropout_impl == "counter":  # every run draws the same masks
        from megatron_integration.capture.te_graph_helper import chunk_decoder
        from megatron_integration.layers.counter_dropout import use_counter_dropout

        for chunk in chunks:
            use_counter_dropout(chunk_decoder(chunk))
        if cfg.megatron.cuda_graph_impl == FULL_ITERATION:  # the embedding is in the graph too
            from megatron.core.utils import get_attr_wrapped_model

            from megatron_integration.layers.counter_dropout import use_counter_embedding_dropout

            for chunk in chunks:
                use_counter_embedding_dropout(
                    get_attr_wrapped_model(chunk, "decoder", return_model_obj=True))
    helper = None
    fused_mhc = cfg.megatron.use_fused_mhc if branch != "core" else None
    if run == FUSED_EAGER:
        from megatron_integration.capture.te_graph_helper import chunk_decoder
        from mhc_cg.lab.megatron_harness.fused_eager import use_fused_eager

        for chunk in chunks:
            use_fused_eager(chunk_decoder(chunk))
    elif run == OURS_FULL:  # the static runtime, no layer graphs: the whole iteration is one graph
        from megatron_integration.capture.te_graph_helper import install_static_runtime

        install_static_runtime(chunks, config, setup.seq_length, setup.micro_batch_size,
                               fused_mhc)
    elif run.endswith("_graphed_mhc"):
        helper = TECudaGraphHelper(chunks, config, setup.seq_length, setup.micro_batch_size)
    elif run == OURS:
        recompute_graphs = (None if branch == "core"  # MHCTransformerConfig's own scope says
                            else megatron_config_kwargs(cfg, branch)[1])
        helper = make_te_graph_helper(chunks, config, setup.seq_length, setup.micro_batch_size,
                                      recompute_graphs=recompute_graphs,
                                      backend=get_backend("tape") if cpu else None,
                                      fused_mhc=fused_mhc)
    return chunks, helper


def branch_layer_cost(cfg: RunConfig, branch: str) -> dict:
    """One layer's step, native against fused (:mod:`mhc_cg.lab.megatron_harness.layer_cost`),
    at ``cfg``'s shape, the branch's config as its run without recompute has it."""
    from mhc_cg.lab.megatron_harness.layer_cost import layer_cost

    from megatron_integration.layers.dev_layer import layer_steps_of
    config, spec = _layer_config(cfg, branch, cpu=True)
    return layer_cost(config, spec, cfg.model.seq_length, cfg.train.micro_batch_size,
                      layer_steps_of(config, True))


def _layer_config(cfg: RunConfig, branch: str, cpu: bool, **overrides):
    """The branch's config of its run without recompute at dropout 0 (the same mask op in every
    variant), and the spec of one layer."""
    kwargs = run_kwargs(megatron_config_kwargs(cfg, branch)[0], f"{branch}_eager_none", branch)
    config = transformer_config({**kwargs, "hidden_dropout": 0.0, **overrides})
    return config, decoder_spec(branch, config, None, cpu=cpu, graphed=False)


def branch_layer_timing(cfg: RunConfig, branch: str, steps: int, warmup: int) -> dict:
    """One layer's step timed native, fused and (dev) with dev's own fused module
    (:mod:`mhc_cg.lab.megatron_harness.layer_timing`), at ``cfg``'s shape."""
    from mhc_cg.lab.megatron_harness.layer_timing import layer_timing

    from megatron_integration.layers.dev_layer import layer_steps_of
    cpu = not torch.cuda.is_available()
    config, spec = _layer_config(cfg, branch, cpu)
    theirs = _layer_config(cfg, branch, cpu, use_fused_mhc=True)[0] if branch == "dev" else None
    return layer_timing(config, spec, cfg.model.seq_length, cfg.train.micro_batch_size,
                        layer_steps_of(config, True), steps=steps, warmup=warmup,
                        dev_fused_config=theirs)


def rank_runs(cfg: RunConfig, runs: list[str], branch: str, cpu: bool) -> dict:
    """Train each of ``runs`` on this rank; ``{name: this rank's measurements}``, or
    ``{name: {"refused": Megatron's message}}`` for a run the branch's config refuses."""
    from megatron.core import parallel_state

    from mhc_cg.lab.megatron_harness.training import use_microbatches

    use_microbatches(setup_of(cfg))
    where = {"rank": torch.distributed.get_rank(),
             "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
             "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
             "ep_rank": parallel_state.get_expert_model_parallel_rank()}
    log_steps = (parallel_state.is_pipeline_last_stage(ignore_virtual=True) and where["tp_rank"] == 0
                 and parallel_state.get_data_parallel_rank() == 0)
    results = {}
    for run in runs:
        try:
            chunks, helper = build_run(run, cfg, branch, cpu)
        except ValueError as refused:
            if not (run.endswith("_graphed_mhc") or run == DEV_FULL):  # dev's own graphed runs
                raise
            results[run] = {"refused": str(refused).splitlines()[0], **where}
            continue
        results[run] = {**where, **train_run(run, chunks, setup_of(cfg), helper=helper, cpu=cpu,
                                             log_steps=log_steps,
                                             full_iteration=run in _FULL_ITERATION_RUNS)}
    return results


def compare_ranks(per_rank: list[dict], branch: str,
                  checked: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Every rank's results as ``{"runs": {name: {"losses", "ranks": [...]}}, "bit_identical",
    "mismatches"}``: ``bit_identical`` holds when each checked run's (default: ``mhc_cg``'s)
    losses and every gradient byte on every rank equal each of its reference runs' (``None``
    when there is nothing to compare); ``checked``: :func:`checked_runs`."""
    names = list(per_rank[0])
    runs = {}
    for name in names:
        ranks = sorted((r[name] for r in per_rank), key=lambda r: r["rank"])
        if "refused" in ranks[0]:
            runs[name] = {"refused": ranks[0]["refused"], "losses": [], "ranks": ranks}
            continue
        losses = next((r["losses"] for r in ranks if r["losses"]), [])
        runs[name] = {"losses": losses, "ranks": ranks}
    mismatches = []
    compared = False
    for run, refs in (checked or {OURS: references(branch)}).items():
        present = [ref for ref in refs if ref in runs and "refused" not in runs[ref]]
        if run not in runs or "refused" in runs[run] or not present:
            continue
        compared = True
        for ref in present:
            if runs[run]["losses"] != runs[ref]["losses"]:
                steps = [i + 1 for i, (a, b) in enumerate(zip(runs[run]["losses"],
                                                              runs[ref]["losses"])) if a != b]
                mismatches.append(f"{run} losses differ from {ref} at steps {steps}")
            for ours, theirs in zip(runs[run]["ranks"], runs[ref]["ranks"]):
                steps = [i + 1 for i, (a, b) in enumerate(zip(ours["grad_digests"],
                                                              theirs["grad_digests"])) if a != b]
                if steps:
                    mismatches.append(f"{run} gradients on rank {ours['rank']} differ from {ref} "
                                      f"at steps {steps}")
    identical = not mismatches if compared else None
    return {"runs": runs, "bit_identical": identical, "mismatches": mismatches}


def capturing_function() -> dict | None:
    """The ``make_graphed_callables`` megatron's TE graph helper calls: its file and sha256, read
    from its code object, and TE's version; None where megatron has no TE graph support."""
    from megatron.core import utils
    from megatron.core.transformer import cuda_graphs

    function = getattr(cuda_graphs, "make_graphed_callables", None)
    if function is None:
        return None
    from mhc_cg.graphs.te import source_of

    return {**source_of(function), "te_version": str(utils.get_te_version())}


def child_main(argv: list[str]) -> None:
    """``SPEC.json OUT_DIR RANK WORLD PORT``; ``SPEC``: ``{"config": RunConfig as a dict, "runs":
    [...], "device": ..., "branch": "main" | "dev"}``."""
    spec = json.loads(Path(argv[0]).read_text())
    rank, world, port = int(argv[2]), int(argv[3]), int(argv[4])
    cpu = spec["device"] != "cuda"
    cfg = RunConfig.from_dict(spec["config"])
    if cpu:
        from mhc_cg.lab.megatron_harness.megatron_on_cpu import install_cpu_shims

        install_cpu_shims()
        if cfg.megatron.cuda_graph_impl == FULL_ITERATION:
            from mhc_cg.lab.megatron_harness.full_iteration_on_tape import \
                install_full_iteration_shims

            install_full_iteration_shims()
    import megatron.core  # noqa: F401  (before TransformerEngine's stand-in, see child_process)

    from mhc_cg.lab.megatron_harness.child_process import STANDIN_ENV, load_te_standin
    from mhc_cg.lab.megatron_harness.training import init_ranks

    if os.environ.get(STANDIN_ENV):
        load_te_standin(os.environ[STANDIN_ENV])

    p = cfg.parallel
    init_ranks(cpu, cfg.train.seed, rank=rank, world_size=world, port=port, tp_size=p.tp_size,
               pp_size=p.pp_size, vpp_size=p.vpp_size, ep_size=p.ep_size)
    if spec.get("layer_cost"):
        result = {"layer_cost": branch_layer_cost(cfg, spec["branch"])}
    elif spec.get("layer_time"):
        result = {"layer_time": branch_layer_timing(cfg, spec["branch"], **spec["layer_time"])}
    else:
        result = rank_runs(cfg, spec["runs"], spec["branch"], cpu)
    out = {"runs": result, "megatron_core": megatron.core.__file__,
           "capturing_function": capturing_function()}
    Path(argv[1], f"rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    child_main(sys.argv[1:])
