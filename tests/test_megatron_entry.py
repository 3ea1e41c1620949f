"""Megatron-LM's own training entry (``pretrain_gpt.py``: its argument parser, ``pretrain()``,
``train()``, its own TE graph helper construction at ``cuda_graph_warmup_steps``, mock data) runs
with mhc_cg enabled only by what ``examples/megatron/`` documents: the lines of its diff in the
user's copy of the script and Megatron's own flags. For main and dev, on the CPU
(``mhc_cg.lab.megatron_harness.entry_on_cpu``): four iterations, the last two replaying the graphs,
losses bit for bit those of the same entry run by Megatron alone; mhc_cg's recompute graphs
captured and replayed; Megatron's files unchanged. Dev with ``--use-fused-mhc`` besides: mhc_cg's
fused kernels in every iteration, graphed and eager (no capture) bit for bit alike, within
tolerance of Megatron alone on its native ops. DeepSeek-V4 as dev builds it (its own specs, on the
CPU stand-in of TE's modules), under layer graphs and under full-iteration capture: bit for bit
Megatron alone, and resumed from its iteration-2 checkpoint bit for bit."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mhc_cg.lab.megatron_harness.child_process import (extract_snapshot, snapshot_archive,
                                                   third_party_dirs)
from mhc_cg.lab.megatron_harness.entry_runs import alone as entry_alone, flag_words

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "megatron"
ITERATIONS, WARMUP = 4, 2


def flags(name: str) -> list[str]:
    """The flags of ``examples/megatron/flags.NAME``, comments left out."""
    return flag_words([name])


def alone(branch_flags: list[str]) -> list[str]:
    """The same flags for Megatron alone: mHC on, the branch's own layer without mhc_cg's hook,
    no recompute, no graphs."""
    return ["mhc" if word == "mhc_graphed" else word for word in entry_alone(branch_flags)]


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
            and p.suffix != ".so"}


@pytest.fixture(scope="module", params=["main", "dev"])
def checkout(request, tmp_path_factory):
    """A Megatron-LM checkout of the branch (core plus entry snapshots), its files' hashes."""
    branch = request.param
    core = snapshot_archive(branch)
    entry = next((Path(found) for d in third_party_dirs()
                  for found in sorted(glob.glob(str(d / f"megatron-lm-entry-{branch}-*.tar.gz")))),
                 None)
    assert core is not None and entry is not None, f"Megatron-LM {branch}'s snapshots not found"
    root = extract_snapshot(core, tmp_path_factory.mktemp(f"megatron_{branch}"))
    extract_snapshot_entry(entry, root)
    return branch, root, tree_hashes(root)


def extract_snapshot_entry(archive: Path, root: Path) -> None:
    import tarfile

    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")


def run_entry(root: Path, script: str, args: list[str], record: Path) -> dict:
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           # megatron compiles its dataset helpers with the python3 on the PATH (pybind11)
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "MHC_CG_ENTRY_RECORD": str(record)}
    done = subprocess.run([sys.executable, "-m", "mhc_cg.lab.megatron_harness.entry_on_cpu", script,
                           *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(record.read_text())


@pytest.fixture(scope="module")
def user_script(checkout):
    """The user's script: Megatron's ``pretrain_gpt.py`` with the example's lines."""
    branch, root, _ = checkout
    script = root / "pretrain_gpt_mhc.py"
    patched = subprocess.run(["patch", "-o", str(script), str(root / "pretrain_gpt.py")],
                             stdin=(EXAMPLE / f"pretrain_gpt.{branch}.diff").open(),
                             capture_output=True, text=True)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    return script


@pytest.fixture(scope="module")
def megatron_alone(checkout, tmp_path_factory):
    """The entry run by Megatron alone on its native mHC ops: the reference of every run here."""
    branch, root, _ = checkout
    record = tmp_path_factory.mktemp(f"alone_{branch}") / "alone.json"
    return run_entry(root, "pretrain_gpt.py", flags("tiny") + flags("cpu") + alone(flags(branch)),
                     record)


def test_pretrain_gpt_with_the_documented_lines_trains_as_megatron_alone(checkout, user_script,
                                                                         megatron_alone, tmp_path):
    branch, root, hashes = checkout
    tiny, cpu, mhc = flags("tiny"), flags("cpu"), flags(branch)
    assert tiny[tiny.index("--train-iters") + 1] == str(ITERATIONS)
    assert mhc[mhc.index("--cuda-graph-warmup-steps") + 1] == str(WARMUP)
    ours = run_entry(root, user_script.name, tiny + cpu + mhc, tmp_path / "ours.json")
    reference = megatron_alone
    assert len(ours["losses"]) == ITERATIONS and ours["losses"] == reference["losses"]
    assert set(ours["fused_ops"]) == {0}  # the layers' own mHC ops, without --use-fused-mhc
    # Megatron's train() built mhc_cg's helper; the graphs were captured at the warm-up's end
    # and the recompute graphs replayed in the graphed iterations
    assert ours["mhc_cg_helpers"] == 1 and reference["mhc_cg_helpers"] == 0
    assert ours["recompute_graphs"] > 0
    assert ours["recompute_graph_replays"] >= (ITERATIONS - WARMUP) * 1
    assert tree_hashes(root).items() >= hashes.items()  # Megatron's own files as shipped


# |loss - Megatron alone's| allowed with mhc_cg's fused kernels, relative: an fp32 model whose mHC
# rounds otherwise (measured 0 at this shape: the mean loss's own rounding hides the kernels'; the
# gradients' differences are fused_block_job's, tests/test_megatron_dev.py)
FUSED_LOSS_TOLERANCE = 1e-5


@pytest.mark.parametrize("checkout", ["dev"], indirect=True)
def test_dev_with_use_fused_mhc_runs_mhc_cgs_kernels_graphed_and_eager_alike(checkout, user_script,
                                                                            megatron_alone,
                                                                            tmp_path):
    """Dev's ``--use-fused-mhc`` with the documented lines: every iteration dispatches mhc_cg's
    fused ops (the helper installs the static runtime before the first); the graphed run
    (capture after 2 iterations) and the same run never capturing (``--cuda-graph-warmup-steps``
    past the last iteration) give the same losses bit for bit, within tolerance of Megatron
    alone on its native ops."""
    branch, root, _ = checkout
    base = flags("tiny") + flags("cpu") + flags(branch) + ["--use-fused-mhc"]
    at = base.index("--cuda-graph-warmup-steps") + 1
    never = [*base[:at], str(ITERATIONS), *base[at + 1:]]
    graphed = run_entry(root, user_script.name, base, tmp_path / "graphed.json")
    eager = run_entry(root, user_script.name, never, tmp_path / "eager.json")
    assert graphed["recompute_graph_replays"] > 0 and eager["recompute_graphs"] == 0
    assert graphed["losses"] == eager["losses"]
    assert len(graphed["fused_ops"]) == ITERATIONS and min(graphed["fused_ops"]) > 0
    for ours, theirs in zip(graphed["losses"], megatron_alone["losses"]):
        a, b = (float.fromhex(d["lm loss"]) for d in (ours, theirs))
        assert abs(a - b) <= FUSED_LOSS_TOLERANCE * abs(b), (a, b)


@pytest.mark.parametrize("checkout", ["dev"], indirect=True)
def test_a_run_resumed_from_its_iteration_2_checkpoint_is_bit_identical(checkout, user_script,
                                                                        tmp_path):
    """Megatron's own ``--save`` / ``--load`` (``torch_dist``) with mhc_cg on: a run saves at
    iterations 2 and 4; restarted from its iteration-2 checkpoint, as after a crash there, the
    rest of it (Megatron warms up again, then captures: the graphs and mhc_cg's recompute graphs
    made anew after the load) gives the uninterrupted run's losses and gradient norms bit for
    bit, with the same recompute blocks and with another size; a truncated checkpoint stops the
    run with Megatron's own error."""
    branch, root, _ = checkout
    base = flags("tiny") + flags("cpu") + flags(branch)
    at = base.index("--cuda-graph-warmup-steps") + 1
    base = [*base[:at], "1", *base[at + 1:]]  # one eager step, then graphs, before and after
    saved = tmp_path / "checkpoints"
    whole = run_entry(root, user_script.name,
                      base + ["--save", str(saved), "--save-interval", "2",
                              "--ckpt-format", "torch_dist"], tmp_path / "whole.json")
    assert sorted(p.name for p in saved.iterdir()) == ["iter_0000002", "iter_0000004",
                                                       "latest_checkpointed_iteration.txt"]
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(saved / "iter_0000002")).read_metadata().state_dict_metadata)
    assert any("hyper_connection" in key for key in keys)  # Megatron's own mHC parameters
    # none of mhc_cg's static buffers (arena, persistent sets, graphs' inputs) in it
    assert not [key for key in keys if any(w in key for w in ("mhc_static", "arena", "slot"))]
    (saved / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = run_entry(root, user_script.name,
                        base + ["--load", str(saved), "--ckpt-format", "torch_dist"],
                        tmp_path / "resumed.json")
    assert len(whole["losses"]) == ITERATIONS and len(resumed["losses"]) == ITERATIONS - 2
    assert resumed["losses"] == whole["losses"][2:]
    assert resumed["grad_norms"] == whole["grad_norms"][2:] and None not in whole["grad_norms"]
    assert whole["recompute_graph_replays"] > 0 and resumed["recompute_graph_replays"] > 0
    # another recompute block size after the load: the recompute is exact, the state the
    # checkpoint's, so still bit for bit (one block of all 4 layers, one recompute graph)
    at = base.index("--mhc-recompute-layer-num") + 1
    regrouped = run_entry(root, user_script.name,
                          [*base[:at], "4", *base[at + 1:], "--load", str(saved),
                           "--ckpt-format", "torch_dist"], tmp_path / "regrouped.json")
    assert regrouped["losses"] == whole["losses"][2:]
    assert regrouped["grad_norms"] == whole["grad_norms"][2:]
    assert regrouped["recompute_graphs"] == 1
    # a corrupt checkpoint: Megatron's own error, promptly, not a hang or a wrong run
    shard = next((saved / "iter_0000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    broken = subprocess.run([sys.executable, "-m", "mhc_cg.lab.megatron_harness.entry_on_cpu",
                             user_script.name, *base, "--load", str(saved), "--ckpt-format",
                             "torch_dist"], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    assert broken.returncode != 0 and "iteration        3/" not in broken.stdout


# DeepSeek-V4 as dev builds it on the user's own layers, both of dev's paths: the GPT path
# (pretrain_gpt.py, examples/megatron/flags.dsv4: dsv4_hybrid attention, hash-routed MoE, MTP) and
# the hybrid stack (pretrain_hybrid.py, flags.dsv4_hybrid), under partial capture and under
# full-iteration capture (the hybrid's with dense feed-forward layers: flags.dsv4_hybrid_full_iteration)
DSV4_PATHS = {"gpt": ("pretrain_gpt", "dsv4"), "hybrid": ("pretrain_hybrid", "dsv4_hybrid")}
DSV4_CAPTURES = {"partial": "dsv4_mhc_cg", "full_iteration": "dsv4_full_iteration"}
DSV4_RESUMED = [("gpt", "partial"), ("gpt", "full_iteration"), ("hybrid", "partial")]
DSV4_RUNS = [(path, capture) for path in DSV4_PATHS for capture in DSV4_CAPTURES]


def with_warmup(args: list[str], steps: int) -> list[str]:
    at = args.index("--cuda-graph-warmup-steps") + 1
    return [*args[:at], str(steps), *args[at + 1:]]


def patched_script(root: Path, script: str) -> Path:
    """Megatron's ``script``.py with the example's lines (``examples/megatron/SCRIPT.dev.diff``)."""
    out = root / f"{script}_mhc.py"
    patched = subprocess.run(["patch", "-o", str(out), str(root / f"{script}.py")],
                             stdin=(EXAMPLE / f"{script}.dev.diff").open(),
                             capture_output=True, text=True)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    return out


def dsv4_flags(path: str, capture: str) -> list[str]:
    names = ["tiny", "cpu", DSV4_PATHS[path][1], DSV4_CAPTURES[capture]]
    if path == "hybrid" and capture == "full_iteration":
        names.append("dsv4_hybrid_full_iteration")
    return [word for name in names for word in flags(name)]


@pytest.fixture(scope="module")
def dsv4_runs(checkout, tmp_path_factory):
    """Per path and capture: Megatron alone on the same model; the documented run (4 iterations,
    graphs after 2), saving at iterations 2 and 4; and (``DSV4_RESUMED``) that run resumed from
    iteration 2, warmed up one step there so that its last iteration replays graphs captured
    after the load."""
    branch, root, _ = checkout
    scripts = {script: patched_script(root, script).name for script, _ in DSV4_PATHS.values()}
    runs = {}
    for path, capture in DSV4_RUNS:
        out = tmp_path_factory.mktemp(f"dsv4_{path}_{capture}")
        script, base = DSV4_PATHS[path][0], dsv4_flags(path, capture)
        saved, ckpt = out / "checkpoints", ["--ckpt-format", "torch_dist"]
        saving = ["--save", str(saved), "--save-interval", "2", *ckpt] \
            if (path, capture) in DSV4_RESUMED else []
        runs[path, capture] = {
            "alone": run_entry(root, f"{script}.py", alone(base), out / "alone.json"),
            "ours": run_entry(root, scripts[script], base + saving, out / "ours.json")}
        if saving:
            (saved / "latest_checkpointed_iteration.txt").write_text("2")
            runs[path, capture]["resumed"] = run_entry(
                root, scripts[script], with_warmup(base, 1) + ["--load", str(saved), *ckpt],
                out / "resumed.json")
    return runs


@pytest.mark.parametrize("checkout", ["dev"], indirect=True)
@pytest.mark.parametrize("path,capture", DSV4_RUNS)
def test_deepseek_v4_trains_under_mhc_cg_bit_for_bit_as_megatron_alone(checkout, dsv4_runs,
                                                                       path, capture):
    """Dev's own ``pretrain_gpt.py`` and ``pretrain_hybrid.py`` build DeepSeek-V4 from dev's own
    specs (the GPT path's builders, the hybrid stack's ``hybrid_dsv4_stack_spec``), on the CPU
    stand-in of TE's modules; with the documented lines and mhc_cg's flags each trains four
    iterations, the last two replaying the graphs (mhc_cg's recompute graphs under partial
    capture, Megatron's whole-iteration graph under full-iteration capture), with the losses and
    gradient norms of Megatron alone (no recompute, no graphs) bit for bit."""
    _, root, hashes = checkout
    ours, reference = dsv4_runs[path, capture]["ours"], dsv4_runs[path, capture]["alone"]
    assert len(ours["losses"]) == ITERATIONS
    assert ours["losses"] == reference["losses"]
    assert ours["grad_norms"] == reference["grad_norms"] and None not in ours["grad_norms"]
    # the rank's static buffers: every layer on the runtime, one persistent set (no pipeline)
    assert ours["static"]["layers"] == 4 and ours["static"]["slot_sets"] == 1
    assert ours["static"]["arena_bytes"] > 0 and not reference["static"]
    if capture == "partial":
        assert ours["mhc_cg_helpers"] == 1 and ours["recompute_graphs"] > 0
        assert ours["recompute_graph_replays"] >= ITERATIONS - WARMUP
    else:
        assert ours["full_iteration_captured"] and not reference["full_iteration_captured"]
        assert ours["full_iteration_replays"] == ITERATIONS - WARMUP
    assert tree_hashes(root).items() >= hashes.items()  # Megatron's own files as shipped


@pytest.mark.parametrize("checkout", ["dev"], indirect=True)
@pytest.mark.parametrize("path,capture", DSV4_RESUMED)
def test_deepseek_v4_resumed_from_its_iteration_2_checkpoint_is_bit_identical(checkout, dsv4_runs,
                                                                              path, capture):
    """DeepSeek-V4 under mhc_cg saved at iteration 2 of 4 (dev's functional tests are
    checkpoint-resume tests) and resumed: the graphs are captured anew after the load, and the
    last two iterations' losses and gradient norms are the uninterrupted run's bit for bit."""
    whole, resumed = dsv4_runs[path, capture]["ours"], dsv4_runs[path, capture]["resumed"]
    assert len(whole["losses"]) == ITERATIONS and len(resumed["losses"]) == ITERATIONS - 2
    assert resumed["losses"] == whole["losses"][2:]
    assert resumed["grad_norms"] == whole["grad_norms"][2:]
    if capture == "partial":
        assert resumed["recompute_graph_replays"] > 0
    else:
        assert resumed["full_iteration_replays"] > 0


@pytest.mark.parametrize("checkout", ["dev"], indirect=True)
def test_mhc_cg_megatron_runs_deepseek_v4_at_pipeline_parallel_2_from_megatrons_entry(checkout):
    """``mhc-cg megatron --config configs/megatron_dev_dsv4_pp2.yaml --compare --json``: dev's
    own ``pretrain_gpt.py`` on two pipeline ranks (one process each, 1F1B over two
    microbatches) as Megatron alone, with dev's own eager mHC recompute, and with mhc_cg's lines:
    mhc_cg's losses and gradient norms are Megatron alone's bit for bit on every rank; each
    rank's static buffers hold the persistent sets its schedule keeps in flight (2, then 1); what
    a layer holds from its forward to its backward is below Megatron alone's on every rank."""
    done = subprocess.run([sys.executable, "-m", "mhc_cg", "megatron", "--config",
                           str(REPO / "configs" / "megatron_dev_dsv4_pp2.yaml"), "--compare",
                           "--json", "--no-progress"], cwd=REPO, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(done.stdout)
    assert result["bit_identical"] is True and not result["mismatches"]
    runs = result["runs"]
    assert set(runs) == {"dev_eager_none", "dev_eager_mhc", "mhc_cg"}
    assert len(runs["mhc_cg"]["losses"]) == ITERATIONS
    ours, alone_ranks = runs["mhc_cg"]["ranks"], runs["dev_eager_none"]["ranks"]
    assert [rank["persistent_slot_sets"] for rank in ours] == [2, 1]
    assert [rank["layers"] for rank in ours] == [2, 2]
    for mine, theirs in zip(ours, alone_ranks):
        assert 0 < mine["saved_bytes_per_layer"] < theirs["saved_bytes_per_layer"]
        assert theirs["persistent_slot_sets"] == 0 and theirs["arena_bytes"] == 0
    assert ours[0]["recompute_graph_replays"] >= ITERATIONS - WARMUP


def test_only_a_cpu_run_turns_megatrons_fusions_off():
    """The fusions a Megatron config sets stay as set on a GPU; a CPU run turns off those whose
    kernels need CUDA (and dev's fused mHC kernels), and says which and why."""
    from megatron_integration.config.field_map import cpu_changes, megatron_config_kwargs
    from mhc_cg.config import load_config

    cfg = load_config(str(REPO / "configs" / "megatron_main_mhc.yaml"))
    on_cpu, on_gpu = (cfg.replace(train={"device": device}) for device in ("cpu", "cuda"))
    assert cpu_changes(on_gpu, "dev") == {}
    assert set(cpu_changes(on_cpu, "dev")) == {"bias_dropout_fusion", "gradient_accumulation_fusion",
                                               "masked_softmax_fusion", "apply_rope_fusion",
                                               "use_fused_mhc"}
    assert all(why for _, why in cpu_changes(on_cpu, "dev").values())
    gpu_kwargs, _ = megatron_config_kwargs(on_gpu, "dev")
    assert not set(cpu_changes(on_cpu, "dev")) & set(gpu_kwargs)
    cpu_kwargs, _ = megatron_config_kwargs(on_cpu, "dev")
    assert cpu_kwargs["masked_softmax_fusion"] is False and cpu_kwargs["use_fused_mhc"] is False
