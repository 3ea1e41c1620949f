"""TransformerEngine's own ``make_graphed_callables`` (TE 2.20.2's ``graph.py``, from its wheel)
captures every per-callable mode on the tape, and each trains bit for bit like eager without
recompute: ``graph.backend: te`` (Note [TE's graph.py from its wheel]).

The wheel is a test requirement: ``make test`` fetches it into ``.cache/peers``; without it these
tests fail, saying so, rather than skip.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import zipfile

import pytest
import torch

from helpers import SCOPE_CASES, assert_training_identical, small_config
from mhc_cg.lab.emulation import cuda_api
from mhc_cg.lab.emulation.backends import graph_api
from mhc_cg.lab.emulation.te_wheel import GRAPH, TE_VERSION, find_te_wheel, te_missing_reason

STEPS = 2


@pytest.fixture(scope="module")
def wheel():
    found = find_te_wheel()
    assert found is not None and found.is_file(), f"{te_missing_reason()} (make test does)"
    return found.resolve()


def wheel_graph_sha256(wheel) -> str:
    with zipfile.ZipFile(wheel) as z:
        return hashlib.sha256(z.read(GRAPH)).hexdigest()


def test_te_backend_captures_with_the_wheels_own_graph_py(wheel):
    """The function that captures is TE's, read from the wheel: its code object's file is the
    wheel's ``graph.py`` and its bytes hash as that member's; no ``transformer_engine`` becomes
    importable for anyone else (Megatron's ``try: import transformer_engine`` still fails)."""
    api = graph_api("te")
    function = api.function
    assert function.__code__.co_filename == f"{wheel}/{GRAPH}"
    assert api.source() == {"file": f"{wheel}/{GRAPH}", "sha256": wheel_graph_sha256(wheel),
                            "origin": "wheel", "version": TE_VERSION}
    assert function.__name__ == "make_graphed_callables" and api.name == "te"
    assert not [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]
    with pytest.raises(ImportError):
        import transformer_engine  # noqa: F401


def counting_replays(monkeypatch) -> list[int]:
    """Replays of graphs captured through ``torch.cuda.CUDAGraph`` as TE's code sees it."""
    count = [0]
    replay = cuda_api.BackendCUDAGraph.replay

    def counted(self):
        count[0] += 1
        replay(self)

    monkeypatch.setattr(cuda_api.BackendCUDAGraph, "replay", counted)
    return count


@pytest.mark.parametrize("mode, case", [("graphed_none", "attn_mlp"), ("graphed_static", "attn_mlp"),
                                        ("attn_split", "attn"), ("graphed_static", "moe_partial")])
def test_every_mode_captured_by_tes_function_trains_like_eager(mode, case, monkeypatch):
    """Sublayer graphs (and for graphed_static the recompute graphs, captured into TE's pool by
    TE's capture-time hooks; with MoE partial capture, the layer graph ending at megatron-core's
    signal), every gradient and loss equal to eager_none's at every step."""
    scopes, experts = SCOPE_CASES[case]
    cfg = small_config(scopes, num_experts=experts)
    cfg.graph = dataclasses.replace(cfg.graph, backend="te")
    replays = counting_replays(monkeypatch)
    assert_training_identical(cfg, mode, STEPS)
    assert replays[0] > 0  # TE's graphs, replayed on the tape


def test_pp2_vpp2_ranks_capture_along_their_order_with_tes_function():
    """Each pipeline rank's sublayer graphs, one per (chunk, microbatch, sublayer), captured by
    TE's function along the rank's order (``_order``, ``_num_layers_per_chunk``, its static
    inputs shared along it with ``_reuse_graph_input_output_buffers``): losses and every gradient
    equal to the same model on one process."""
    from test_distributed_pipeline import (CONFIGS, STEPS as PIPELINE_STEPS,
                                           check_against_single_process, check_planned_sets)
    from mhc_cg.config import load_config
    from mhc_cg.lab.pipeline.driver import train_pipeline

    cfg = load_config(CONFIGS / "tiny_pp2_vpp2.yaml")
    cfg = cfg.replace(graph={"backend": "te"})
    result = train_pipeline(cfg, steps=PIPELINE_STEPS, progress=False, collect_grads=True)
    assert {rank["capture_api"] for rank in result.ranks} == {"te"}
    check_planned_sets(cfg, result)
    check_against_single_process(cfg, result)


def test_the_command_line_compares_every_mode_under_tes_function(capsys):
    """``mhc-cg train --config configs/tiny_cpu_te.yaml --compare``: every mode bit for bit like
    eager_none, its graphs captured by TE's function; ``config check`` says which TE runs."""
    from mhc_cg.cli import main

    assert main(["config", "check", "configs/tiny_cpu_te.yaml"]) == 0
    checked = capsys.readouterr().out
    assert "on te" in checked and "# te: TransformerEngine 2.20.2's make_graphed_callables from " \
        "its wheel's source" in checked
    assert main(["train", "--config", "configs/tiny_cpu_te.yaml", "--compare", "--steps", "2"]) == 0
    table = capsys.readouterr().out
    for mode in ("graphed_none", "graphed_static", "attn_split", "graphed_full_static"):
        row = next(line for line in table.splitlines() if line.startswith(mode + " "))
        assert "bit-identical" in row, row


def test_the_cost_model_records_tes_own_function_on_its_backend():
    """With ``graph.backend: te`` ``mhc-cg cost`` captures through TE's function over its
    recording backend: the same graphs as under ours (a forward and a backward per sublayer, the
    recompute graphs in the same pool), and what TE keeps outside its pool (one grad-output
    buffer per shape) counted as static buffers."""
    from mhc_cg.lab.cost.report import cost_mode, mode_configs

    cfg = small_config(SCOPE_CASES["attn_mlp"][0]).replace(model={"recompute": "block"})
    costed = {}
    for backend in ("tape", "te"):
        runs = dict(mode_configs(cfg.replace(graph={"backend": backend}), "meta")[0])
        costed[backend] = cost_mode(runs["graphed_static"])
    ours, tes = costed["tape"], costed["te"]
    assert [g["kind"] for g in tes["graphs"]] == [g["kind"] for g in ours["graphs"]]
    assert tes["graph_replays_per_step"] == ours["graph_replays_per_step"]
    assert tes["static_buffer_bytes"] > 0 and tes["peak_bytes"] > 0
    # TE copies each incoming grad into its own buffer and accumulates parameter grads eagerly
    assert tes["bytes_per_step"] > ours["bytes_per_step"]


# ---- Note [TE's files by their hashes] -------------------------------------------------------

def _wheel_with(wheel, tmp_path, member: str, change) -> "Path":
    """A copy of TE's wheel with ``member``'s bytes passed through ``change``."""
    copy = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(copy, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(item, change(data) if item.filename == member else data)
    return copy


def test_the_wheels_files_are_te_2_20_2s_own(wheel):
    """The table holds the hash of every file of TE's that runs here, and the wheel found is
    the one PyPI publishes (its index's sha256)."""
    from mhc_cg.lab.benchmarks.kernel_peers import TE_FILES
    from mhc_cg.lab.emulation.te_wheel import REAL, TE_FILE_SHA256, TE_WHEEL_SHA256

    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == TE_WHEEL_SHA256
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        run = {f"{p}/__init__.py" if f"{p}/__init__.py" in names else f"{p}.py"
               for p in (name.replace(".", "/") for name in REAL)}
        run |= {"transformer_engine/pytorch/distributed.py", *TE_FILES}
        assert set(TE_FILE_SHA256) == run
        assert all(hashlib.sha256(z.read(m)).hexdigest() == h for m, h in TE_FILE_SHA256.items())


def test_a_changed_te_file_is_refused_by_name_before_it_runs(wheel, tmp_path):
    """One comment added to TE's graph.py: the loader refuses the file, naming it and the fix,
    and runs none of it; so does the peers' loader for a changed mhc.py in a folder."""
    from mhc_cg.core.errors import ConfigError
    from mhc_cg.lab.benchmarks.kernel_peers import load_te
    from mhc_cg.lab.emulation.te_wheel import TEWheel

    ran = "raise SystemExit('ran')\n"
    tampered = _wheel_with(wheel, tmp_path, GRAPH, lambda b: ran.encode() + b)
    with pytest.raises(ConfigError, match=r"graph\.py is not TransformerEngine 2\.20\.2's.*"
                                          r"pip download --no-deps transformer-engine==2\.20\.2"):
        TEWheel(tampered).graph_module()
    folder = tmp_path / "folder"
    with zipfile.ZipFile(wheel) as z:
        for member in ("transformer_engine/common/triton/mhc.py",
                       "transformer_engine/pytorch/triton/mhc.py"):
            z.extract(member, folder)
    (folder / "transformer_engine/pytorch/triton/mhc.py").write_text(ran)
    with pytest.raises(ConfigError, match=r"pytorch/triton/mhc\.py is not TransformerEngine"):
        load_te(str(folder))


def test_another_te_version_is_refused(wheel, tmp_path):
    from mhc_cg.core.errors import ConfigError
    from mhc_cg.lab.emulation.te_wheel import TEWheel

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    other = _wheel_with(wheel, tmp_path, meta,
                        lambda b: b.replace(b"Version: 2.20.2", b"Version: 2.21.0"))
    with pytest.raises(ConfigError, match="is TransformerEngine 2.21.0; mhc_cg runs 2.20.2's"):
        TEWheel(other)
