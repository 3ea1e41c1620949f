"""DeepSeek-V4 as Megatron-LM dev builds it, from dev's own training entries with the lines and
flags of ``examples/megatron/``, on the CPU stand-in of TE's modules: the GPT path
(``pretrain_gpt.py``) and the hybrid stack (``pretrain_hybrid.py``), under layer graphs and under
full-iteration capture, bit for bit Megatron alone; resumed from an iteration-2 checkpoint bit
for bit, with another recompute block size too, and a corrupt checkpoint refused by Megatron; at
pipeline parallel 2 through ``mhc-cg megatron``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from entry_helpers import (ITERATIONS, REPO, WARMUP, alone, flags, megatron_checkout,
                           patched_script, run_entry, tree_hashes, with_warmup)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """Megatron-LM dev's checkout (core plus entry snapshots), its files' hashes."""
    return megatron_checkout("dev", tmp_path_factory)


# DeepSeek-V4 as dev builds it on the user's own layers, both of dev's paths: the GPT path
# (pretrain_gpt.py, examples/megatron/flags.dsv4: dsv4_hybrid attention, hash-routed MoE, MTP) and
# the hybrid stack (pretrain_hybrid.py, flags.dsv4_hybrid), under partial capture and under
# full-iteration capture (the hybrid's with dense feed-forward layers: flags.dsv4_hybrid_full_iteration)
DSV4_PATHS = {"gpt": ("pretrain_gpt", "dsv4"), "hybrid": ("pretrain_hybrid", "dsv4_hybrid")}
DSV4_CAPTURES = {"partial": "dsv4_mhc_cg", "full_iteration": "dsv4_full_iteration"}
DSV4_RESUMED = [("gpt", "partial"), ("gpt", "full_iteration"), ("hybrid", "partial")]
DSV4_RUNS = [(path, capture) for path in DSV4_PATHS for capture in DSV4_CAPTURES]
FAULTS = ("gpt", "partial")  # the run whose checkpoint also meets the faults of a load


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
            load = ["--load", str(saved), *ckpt]
            runs[path, capture]["resumed"] = run_entry(
                root, scripts[script], with_warmup(base, 1) + load, out / "resumed.json")
        if (path, capture) == FAULTS:
            runs[path, capture].update(faults(root, scripts[script], with_warmup(base, 1),
                                              saved, load, out))
    return runs


def faults(root, script: str, base: list[str], saved, load: list[str], out) -> dict:
    """What a load meets beside a plain resume: the checkpoint's keys; another recompute block
    size (one block of all 4 layers); a shard truncated to half (last: it spoils the folder)."""
    from torch.distributed.checkpoint import FileSystemReader

    from mhc_cg.lab.megatron_harness.entry_runs import run_ranks

    keys = list(FileSystemReader(str(saved / "iter_0000002")).read_metadata().state_dict_metadata)
    at = base.index("--mhc-recompute-layer-num") + 1
    regrouped = run_entry(root, script, [*base[:at], "4", *base[at + 1:], *load],
                          out / "regrouped.json")
    shard = next((saved / "iter_0000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(RuntimeError) as broken:
        run_ranks(root, script, base + load, out / "broken", timeout=300)
    return {"keys": keys, "regrouped": regrouped, "broken": str(broken.value)}


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


def test_a_deepseek_v4_load_with_another_block_size_or_a_corrupt_shard(dsv4_runs):
    """The checkpoint holds Megatron's own mHC parameters and none of mhc_cg's static buffers;
    a load with another recompute block size trains bit for bit the uninterrupted run (the
    recompute is exact, the state the checkpoint's); a shard truncated to half stops the load
    with Megatron's own error, promptly, before any iteration."""
    runs = dsv4_runs[FAULTS]
    assert any("hyper_connection" in key for key in runs["keys"])
    assert not [key for key in runs["keys"] if any(w in key for w in ("mhc_static", "arena", "slot"))]
    regrouped, whole = runs["regrouped"], runs["ours"]
    assert regrouped["losses"] == whole["losses"][2:]
    assert regrouped["grad_norms"] == whole["grad_norms"][2:]
    assert regrouped["recompute_graphs"] == 1 and regrouped["static"]["block_size"] == 4
    assert "failed" in runs["broken"] and "iteration        3/" not in runs["broken"]


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


@pytest.mark.parametrize("megatron, field, fix", [
    ({"branch": "dev", "flags": ["dsv4"]}, "megatron.flags", "set megatron.entry: pretrain_gpt"),
    ({"branch": "dev", "entry": "pretrain_gpt", "flags": ["dsv4", "dsv5"]}, "megatron.flags",
     "['dsv5'] not found"),
    ({"branch": "dev", "entry": "pretrain_bert", "flags": ["dsv4"]}, "megatron.entry",
     "must be one of ['pretrain_gpt', 'pretrain_hybrid']"),
    ({"branch": "main", "entry": "pretrain_hybrid", "flags": ["dsv4_hybrid"]}, "megatron.entry",
     "set megatron.branch: dev"),
])
def test_a_bad_entry_config_is_one_line_naming_the_fix(tmp_path, capsys, megatron, field, fix):
    """A config of Megatron's own entry that cannot run: exit 2, one line naming the field and the
    fix, before any process starts."""
    import yaml

    from mhc_cg.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"megatron": megatron}))
    assert main(["megatron", "--config", str(path), "--compare"]) == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines()
             if line.startswith(f"mhc-cg megatron: error: {field}:")]
    assert len(lines) == 1 and fix in lines[0], stderr
