"""Megatron-LM's own training entry (``pretrain_gpt.py``: its argument parser, ``pretrain()``,
``train()``, its own TE graph helper construction at ``cuda_graph_warmup_steps``, mock data) runs
with mhc_cg enabled only by what ``examples/megatron/`` documents: the lines of its diff in the
user's copy of the script and Megatron's own flags. For main and dev, on the CPU
(``mhc_cg.lab.megatron_harness.entry_on_cpu``): four iterations, the last two replaying the graphs,
losses bit for bit those of the same entry run by Megatron alone; mhc_cg's recompute graphs
captured and replayed; Megatron's files unchanged. Dev with ``--use-fused-mhc`` besides: mhc_cg's
fused kernels in every iteration, graphed and eager (no capture) bit for bit alike, within
tolerance of Megatron alone on its native ops. DeepSeek-V4, and a run resumed from Megatron's
checkpoint (with another block size, and from a corrupt one): ``tests/test_megatron_dsv4.py``."""

from __future__ import annotations


import pytest

from entry_helpers import (ITERATIONS, REPO, WARMUP, alone, flags, megatron_checkout,
                           patched_script, run_entry, tree_hashes)


@pytest.fixture(scope="module", params=["main", "dev"])
def checkout(request, tmp_path_factory):
    """A Megatron-LM checkout of the branch (core plus entry snapshots), its files' hashes."""
    return megatron_checkout(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def user_script(checkout):
    """The user's script: Megatron's ``pretrain_gpt.py`` with the example's lines."""
    return patched_script(checkout[1], "pretrain_gpt")


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
