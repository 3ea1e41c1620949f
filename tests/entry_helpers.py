"""What the tests of Megatron-LM's own training entry share: a checkout of a branch's snapshots,
the example's flags and lines, and a run of the CPU entry with its record."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mhc_cg.lab.megatron_harness.entry_runs import (alone as entry_alone, entry_checkout,
                                                    flag_words, run_ranks)

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


def megatron_checkout(branch: str, tmp_path_factory) -> tuple[str, Path, dict[str, str]]:
    """A Megatron-LM checkout of the branch (core plus entry snapshots, the user's scripts
    ``SCRIPT_mhc.py`` beside Megatron's: :func:`entry_checkout`), its files' hashes."""
    root = entry_checkout(branch, tmp_path_factory.mktemp(f"megatron_{branch}"))
    return branch, root, tree_hashes(root)


def run_entry(root: Path, script: str, args: list[str], record: Path) -> dict:
    """``script`` with ``args`` on the CPU entry, one process (its record, also at ``record``)."""
    ranks = run_ranks(root, script, args, record.with_suffix(""))
    record.write_text(json.dumps(ranks[0]))
    return ranks[0]


def with_warmup(args: list[str], steps: int) -> list[str]:
    at = args.index("--cuda-graph-warmup-steps") + 1
    return [*args[:at], str(steps), *args[at + 1:]]


def patched_script(root: Path, script: str) -> Path:
    """Megatron's ``script``.py with the example's lines, as :func:`entry_checkout` wrote it."""
    out = root / f"{script}_mhc.py"
    assert out.is_file(), f"{out.name}: no examples/megatron/{script}.BRANCH.diff for this branch"
    return out
