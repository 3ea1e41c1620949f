"""``mhc-cg megatron`` on Megatron-LM's own training entry (``megatron.entry``): the branch's
``pretrain_gpt.py`` or ``pretrain_hybrid.py`` with the flags of ``examples/megatron/`` named by
``megatron.flags``, one process per rank (:mod:`mhc_cg.lab.megatron_harness.entry_on_cpu`, as
``torchrun`` starts them), the model being what Megatron's own builders make of the flags.

The runs, each training the flags' iterations from the same seed:

* ``{branch}_eager_none``: Megatron alone, the script as shipped, no recompute, no graphs;
* ``{branch}_eager_mhc``: Megatron's own eager mHC recompute (the flags' recompute flags, no
  graphs);
* ``mhc_cg``: the user's script with the documented lines (``examples/megatron/SCRIPT.BRANCH.diff``)
  and every flag: mhc_cg's static runtime under Megatron's graphs.

``mhc_cg`` must equal ``{branch}_eager_none`` bit for bit on every rank (losses and gradient
norms); each rank reports what its layers hold from forward to backward and its static buffers.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mhc_cg.config import RunConfig
from mhc_cg.config.rules import EXAMPLE_FLAGS, entry_problems
from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.megatron_harness.child_process import (extract_snapshot, snapshot_archive,
                                                       third_party_dirs)

REPO = Path(__file__).resolve().parents[3]
OURS = "mhc_cg"
# what only mhc_cg's run takes: Megatron's recompute (its own eager run keeps it) and graphs
_RECOMPUTE = ("--recompute-granularity", "--recompute-modules", "--mhc-recompute-layer-num")
_GRAPHS = ("--cuda-graph-impl", "--cuda-graph-modules", "--cuda-graph-warmup-steps")
PROGRESS = "[mhc-cg megatron]"


def flag_words(names: list[str]) -> list[str]:
    """The flags of ``examples/megatron/flags.NAME`` for each name, in order, comments left out."""
    return [word for name in names
            for line in (EXAMPLE_FLAGS / f"flags.{name}").read_text().splitlines()
            if not line.startswith("#") for word in line.split()]


def without(words: list[str], flags: tuple[str, ...]) -> list[str]:
    """``words`` less each of ``flags`` and its value."""
    keep, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            keep.append(word)
    return keep


def alone(words: list[str]) -> list[str]:
    """The flags of Megatron alone: no recompute, no graphs (mHC on)."""
    return without(words, _RECOMPUTE + _GRAPHS)


def ranks_of(words: list[str]) -> int:
    """The processes the flags ask for: tensor x pipeline parallel size (one data-parallel rank)."""
    size = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        values = [words[i + 1] for i, word in enumerate(words[:-1]) if word == flag]
        size *= int(values[-1]) if values else 1
    return size


def entry_checkout(branch: str, into: Path) -> Path:
    """Megatron-LM ``branch``'s core and entry snapshots extracted under ``into``, the user's
    scripts beside Megatron's (``SCRIPT_mhc.py``: Megatron's with the documented lines)."""
    core = snapshot_archive(branch)
    entry = next((Path(found) for d in third_party_dirs()
                  for found in sorted(glob.glob(str(d / f"megatron-lm-entry-{branch}-*.tar.gz")))),
                 None)
    if core is None or entry is None:
        raise ConfigError(f"megatron.entry: Megatron-LM {branch}'s core and entry snapshots "
                          f"(megatron-lm-{branch}-*.tar.gz, megatron-lm-entry-{branch}-*.tar.gz) "
                          f"are not in {[str(d) for d in third_party_dirs()]}")
    root = extract_snapshot(core, into)
    import tarfile

    with tarfile.open(entry) as tar:
        tar.extractall(root, filter="data")
    for diff in sorted((REPO / "examples" / "megatron").glob(f"*.{branch}.diff")):
        script = diff.name.removesuffix(f".{branch}.diff")
        with diff.open() as stdin:
            done = subprocess.run(["patch", "-o", str(root / f"{script}_mhc.py"),
                                   str(root / f"{script}.py")], stdin=stdin,
                                  capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{diff.name} does not apply to {branch}'s {script}.py: "
                               f"{done.stdout}{done.stderr}")
    return root


def run_ranks(root: Path, script: str, words: list[str], records: Path,
              timeout: float = 900) -> list[dict]:
    """``script`` with ``words`` on :func:`ranks_of` processes, one per rank; each rank's record
    (:class:`~mhc_cg.lab.megatron_harness.entry_on_cpu.Record`), rank 0 first."""
    from mhc_cg.lab.pipeline.driver import free_port

    world, port = ranks_of(words), str(free_port())
    records.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               # megatron compiles its dataset helpers with the python3 on the PATH (pybind11)
               "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
               "MHC_CG_ENTRY_RECORD": str(records / f"rank{rank}.json"), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_PORT": port}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mhc_cg.lab.megatron_harness.entry_on_cpu", script, *words],
            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    failed = [(rank, out) for rank, (proc, out) in enumerate(zip(procs, outputs))
              if proc.returncode != 0]
    if failed:
        rank, out = failed[0]
        raise RuntimeError(f"{script} rank {rank} of {world} failed:\n{out[-6000:]}")
    return [json.loads((records / f"rank{rank}.json").read_text()) for rank in range(world)]


def runs_of(branch: str, words: list[str], compare: bool) -> dict[str, tuple[bool, list[str]]]:
    """``{run: (the user's script?, flags)}``, references first."""
    runs = {}
    if compare:
        runs[f"{branch}_eager_none"] = (False, alone(words))
        if "--recompute-modules" in words:
            runs[f"{branch}_eager_mhc"] = (False, without(words, _GRAPHS))
    runs[OURS] = (True, words)
    return runs


def run(cfg: RunConfig, compare: bool, progress: bool = True) -> dict:
    """Every run of the module docstring on every rank, and the comparison."""
    problems = entry_problems(cfg)
    if problems:
        raise ConfigError(problems)
    m = cfg.megatron
    words = flag_words(m.flags)
    result = {"entry": m.entry, "branch": m.branch, "flags": list(m.flags),
              "ranks": ranks_of(words), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="mhc_cg_entry_") as scratch:
        root = entry_checkout(m.branch, Path(scratch))
        for name, (users, flags) in runs_of(m.branch, words, compare).items():
            script = f"{m.entry}_mhc.py" if users else f"{m.entry}.py"
            started = time.perf_counter()
            if progress:
                print(f"{PROGRESS} {name}: {script} on {result['ranks']} rank(s)",
                      file=sys.stderr, flush=True)
            result["runs"][name] = run_ranks(root, script, flags, Path(scratch) / name)
            if progress:
                print(f"{PROGRESS} {name}: done in {time.perf_counter() - started:.1f} s",
                      file=sys.stderr, flush=True)
    reference = result["runs"].get(f"{m.branch}_eager_none")
    result["mismatches"] = [] if reference is None else mismatches(result["runs"], reference)
    result["bit_identical"] = None if reference is None else not any(
        line.startswith(OURS) for line in result["mismatches"])
    return result


def mismatches(runs: dict[str, list[dict]], reference: list[dict]) -> list[str]:
    """One line per run and rank whose losses or gradient norms differ from ``reference``'s."""
    lines = []
    for name, ranks in runs.items():
        for rank, (mine, theirs) in enumerate(zip(ranks, reference)):
            for key in ("losses", "grad_norms"):
                if mine[key] != theirs[key]:
                    lines.append(f"{name} rank {rank}: {key} {mine[key]} != {theirs[key]}")
    return lines


def rank_figures(rank: int, record: dict) -> dict:
    """What ``mhc-cg megatron --json`` shows of one rank of a run."""
    static = record["static"]
    saved = [s for s in record["saved_bytes_per_layer"] if s is not None]
    return {"rank": rank, "saved_bytes_per_layer": saved[-1] if saved else None,
            "persistent_slot_sets": static.get("slot_sets", 0),
            "persistent_set_bytes": static.get("persistent_set_bytes", 0),
            "arena_bytes": static.get("arena_bytes", 0), "layers": static.get("layers"),
            "recompute_graphs": record["recompute_graphs"],
            "recompute_graph_replays": record["recompute_graph_replays"],
            "full_iteration_replays": record["full_iteration_replays"]}


def to_json(result: dict) -> dict:
    return {"entry": result["entry"], "branch": result["branch"], "flags": result["flags"],
            "bit_identical": result["bit_identical"], "mismatches": result["mismatches"],
            "runs": {name: {"losses": _last_stage_losses(ranks),
                            "grad_norms": ranks[0]["grad_norms"],
                            "ranks": [rank_figures(r, rec) for r, rec in enumerate(ranks)]}
                     for name, ranks in result["runs"].items()}}


def _last_stage_losses(ranks: list[dict]) -> list[dict]:
    return next((r["losses"] for r in reversed(ranks) if any(r["losses"])), ranks[-1]["losses"])


def format_table(result: dict) -> str:
    """Per run and rank: the last iteration's loss, saved bytes per layer, static buffers."""
    header = ("run", "rank", "last loss", "saved/layer", "slot sets", "set bytes", "arena",
              "recompute graphs (replays)")
    rows = []
    for name, ranks in result["runs"].items():
        for r, record in enumerate(ranks):
            f, losses = rank_figures(r, record), record["losses"]
            last = float.fromhex(losses[-1]["lm loss"]) if losses and losses[-1] else None
            rows.append((name, str(r), "" if last is None else f"{last:.6f}",
                         str(f["saved_bytes_per_layer"]), str(f["persistent_slot_sets"]),
                         str(f["persistent_set_bytes"]), str(f["arena_bytes"]),
                         f"{f['recompute_graphs']} ({f['recompute_graph_replays']})"))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"Megatron-LM {result['branch']}'s {result['entry']}.py, flags "
             f"{', '.join(result['flags'])}, {result['ranks']} rank(s)"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
    if result["bit_identical"] is not None:
        lines.append(f"mhc_cg bit for bit {result['branch']}_eager_none on every rank: "
                     f"{'yes' if result['bit_identical'] else 'NO'}")
    return "\n".join(lines)
