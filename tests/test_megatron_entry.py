"""Megatron-LM's own training entry (``pretrain_gpt.py``: its argument parser, ``pretrain()``,
``train()``, its own TE graph helper construction at ``cuda_graph_warmup_steps``, mock data) runs
with mhc_cg enabled only by what ``examples/megatron/`` documents: the lines of its diff in the
user's copy of the script and Megatron's own flags. For main and dev, on the CPU
(``mhc_cg.lab.megatron_harness.entry_on_cpu``): four iterations, the last two replaying the graphs,
losses bit for bit those of the same entry run by Megatron alone; mhc_cg's recompute graphs
captured and replayed; Megatron's files unchanged. Dev with ``--use-fused-mhc`` besides: mhc_cg's
fused kernels in every iteration, graphed and eager (no capture) bit for bit alike, within
tolerance of Megatron alone on its native ops. DeepSeek-V4: ``tests/test_megatron_dsv4.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from entry_helpers import (EXAMPLE, ITERATIONS, REPO, WARMUP, alone, flags, megatron_checkout,
                           run_entry, tree_hashes)


@pytest.fixture(scope="module", params=["main", "dev"])
def checkout(request, tmp_path_factory):
    """A Megatron-LM checkout of the branch (core plus entry snapshots), its files' hashes."""
    return megatron_checkout(request.param, tmp_path_factory)


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
