"""Megatron-LM dev's own ``FullCudaGraphWrapper`` (``cuda_graph_impl: full_iteration``) on the tape.

``mhc-cg megatron --compare --json`` on the two shipped configs (tp 1 x pp 1, and pp 2 with one
process per rank) trains dev's GPT through dev's wrapper, imported from the snapshot, whose
``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` / ``graph_pool_handle`` / ``Tensor.cuda`` the
harness serves with the tape (``mhc_cg/lab/megatron_harness/full_iteration_on_tape.py``):

* ``dev_full_iteration_mhc`` (dev's own ``[mhc]`` recompute inside the graph, dropout 0) and
  ``mhc_cg_full_iteration`` (dev's layers on mhc_cg's static runtime, counter dropout 0.1) are
  bit-identical, losses and every gradient byte of every step on every rank, to dev without
  recompute at their dropout;
* the graph was captured once and replayed from the captured step on (its replay count), the last
  step ran no sublayer as Python, and at pp 2 the graph holds the stages' sends and receives;
* a config the wrapper cannot run is refused in one line naming the field and the fix.

The snapshot is ``../shared/third_party/megatron-lm-dev-*.tar.gz``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mhc_cg.config import load_config
from mhc_cg.config.rules import MEGATRON_WARMUP_STEPS, megatron_problems
from megatron_main_oracle import require_snapshot

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"pp1": "configs/megatron_dev_full_iteration.yaml",
           "pp2": "configs/megatron_dev_full_iteration_pp2.yaml"}
GRAPHED = {"dev_full_iteration_mhc": "dev_eager_none_dropout0",
           "mhc_cg_full_iteration": "dev_eager_none"}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def shipped(request):
    require_snapshot("dev")
    path = CONFIGS[request.param]
    proc = subprocess.run([sys.executable, "-m", "mhc_cg", "megatron", "--config", path,
                           "--compare", "--json", "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return load_config(ROOT / path), json.loads(proc.stdout)


def test_both_graphed_runs_are_bit_identical_to_dev_without_recompute(shipped):
    cfg, result = shipped
    assert result["bit_identical"] is True
    assert set(result["runs"]) == {*GRAPHED, *GRAPHED.values()}
    assert result["checked"] == {run: [ref] for run, ref in GRAPHED.items()}
    for run, ref in GRAPHED.items():
        ours, theirs = result["runs"][run], result["runs"][ref]
        assert ours["losses"] == theirs["losses"] and len(ours["losses"]) == cfg.train.steps
        assert [r["pp_rank"] for r in ours["ranks"]] == list(range(cfg.parallel.pp_size))
    # the two references differ (dropout 0.1 against 0): each run is checked against its own
    assert result["runs"]["dev_eager_none"]["losses"] != \
        result["runs"]["dev_eager_none_dropout0"]["losses"]


def test_the_iteration_graph_is_replayed_and_runs_no_python(shipped):
    cfg, result = shipped
    replayed = cfg.train.steps - MEGATRON_WARMUP_STEPS  # the captured step replays too
    for run in GRAPHED:
        for rank in result["runs"][run]["ranks"]:
            assert rank["iteration_graph_replays"] == replayed
            assert rank["iteration_graph_replays_per_step"] == 1
            assert rank["eager_sublayer_calls_per_step"] == {}  # nothing ran as Python
            assert rank["iteration_graph_bytes"] > 0
            collectives = rank["iteration_graph_collectives"]
            if cfg.parallel.pp_size > 1:  # the 1F1B sends and receives are in the graph
                assert collectives["c10d::send"] >= cfg.train.num_microbatches
                assert collectives["c10d::recv_"] >= cfg.train.num_microbatches
            else:
                assert "c10d::send" not in collectives
    for rank in result["runs"]["dev_eager_none"]["ranks"]:  # the eager reference has no graph
        assert "iteration_graph_replays" not in rank
        assert rank["layer_graph_replays_per_step"] == 0


def test_what_each_graphed_run_holds(shipped):
    """Measured in the captured step: dev's [mhc] recompute holds less than dev without it at
    dropout 0, mhc_cg's static runtime less than dev's recompute (with its dropout masks)."""
    cfg, result = shipped
    for index in range(cfg.parallel.pp_size):
        saved = {run: result["runs"][run]["ranks"][index]["saved_bytes_per_layer"]
                 for run in result["runs"]}
        assert saved["dev_full_iteration_mhc"] < saved["dev_eager_none_dropout0"]
        assert saved["mhc_cg_full_iteration"] < saved["dev_full_iteration_mhc"]
        ours = result["runs"]["mhc_cg_full_iteration"]["ranks"][index]
        assert ours["arena_bytes"] > 0 and ours["persistent_slot_sets"] >= 1


def _problems(tmp_path, **changes) -> list[str]:
    import yaml

    data = yaml.safe_load((ROOT / CONFIGS["pp1"]).read_text())
    for key, value in changes.items():
        section, field = key.split("__")
        data[section][field] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return megatron_problems(load_config(path))


@pytest.mark.parametrize("changes, field, fix", [
    ({"megatron__branch": "main"}, "megatron.cuda_graph_impl", "set megatron.branch: dev"),
    ({"graph__cuda_graph_modules": ["attn", "mhc_recompute"]}, "graph.cuda_graph_modules",
     "remove graph.cuda_graph_modules"),
    ({"graph__backend": "te"}, "graph.backend", "set graph.backend: auto"),
    ({"train__steps": 2}, "train.steps", "set train.steps to 3 or more"),
    ({"model__num_experts": 4}, "model.num_experts", "set model.num_experts: null"),
])
def test_a_config_the_wrapper_cannot_run_is_refused_in_one_line(tmp_path, changes, field, fix):
    problems = _problems(tmp_path, **changes)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{field}:") and fix in problems[0] and "\n" not in problems[0]


def test_an_unknown_graph_impl_is_refused(tmp_path):
    from mhc_cg.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"megatron.cuda_graph_impl: must be one of "
                                          r"\['transformer_engine', 'full_iteration'\]"):
        _problems(tmp_path, megatron__cuda_graph_impl="full")
