"""Megatron-LM main's megatron.core in a process of its own: finding it, and running a child there.

No megatron-core release has mHC yet, and Megatron-LM main must not shadow the pinned release in
this process, so work on ``main``'s layer runs in a child process whose ``PYTHONPATH`` puts
``main``'s ``megatron`` first. Where ``main`` comes from, first found wins:

1. ``MHC_CG_MEGATRON_LM``: a Megatron-LM checkout (a folder holding ``megatron/core``) or a
   ``megatron-lm-main-*.tar.gz`` snapshot;
2. the installed megatron-core, if it has mHC (``megatron/core/transformer/hyper_connection.py``);
3. the newest ``megatron-lm-main-*.tar.gz`` in ``MHC_CG_THIRD_PARTY``, else in
   ``../shared/third_party`` beside the repository (one level further up for a git worktree
   kept in a sub-folder): the snapshot the tests use.

A snapshot is extracted into a scratch folder. The tests also find Megatron-LM ``dev``'s snapshot
(``megatron-lm-dev-*.tar.gz``, :func:`snapshot_archive` of ``"dev"``) the same way. Megatron's TE graph helper needs
TransformerEngine, which installs only with CUDA (its wheel is 276 MB): where it is missing the
child loads :mod:`mhc_cg.lab.megatron_harness.te_on_tape` after megatron (TE's graph API on
mhc_cg's graphs: the tape on a CPU, ``torch.cuda.CUDAGraph`` on a GPU; FP8 refused);
``MHC_CG_TE_STANDIN`` names its folder for the child.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mhc_cg.core.errors import ConfigError
from mhc_cg.graphs.te import te_installed

# the folder that holds ``megatron_integration`` (a checkout, or site-packages)
REPO = Path(__file__).resolve().parents[3]


def archive_glob(branch: str = "main") -> str:
    """The file names of a Megatron-LM ``branch``'s snapshots (``main`` or ``dev``)."""
    return f"megatron-lm-{branch}-*.tar.gz"


ARCHIVE_GLOB = archive_glob("main")
MAIN_ENV = "MHC_CG_MEGATRON_LM"
THIRD_PARTY_ENV = "MHC_CG_THIRD_PARTY"
STANDIN_ENV = "MHC_CG_TE_STANDIN"
STANDIN_DIR = Path(__file__).resolve().parent / "te_on_tape"
MHC_MODULE = Path("megatron", "core", "transformer", "hyper_connection.py")


def third_party_dirs() -> list[Path]:
    """Where a snapshot archive is looked for, in order."""
    if THIRD_PARTY_ENV in os.environ:
        return [Path(os.environ[THIRD_PARTY_ENV])]
    return [REPO.parent / "shared" / "third_party", REPO.parent.parent / "shared" / "third_party"]


def snapshot_archive(branch: str = "main") -> Path | None:
    """The newest ``megatron-lm-{branch}-*.tar.gz`` of :func:`third_party_dirs`."""
    for directory in third_party_dirs():
        found = sorted(glob.glob(str(directory / archive_glob(branch))))
        if found:
            return Path(found[-1])
    return None


def extract_snapshot(archive: Path, into: Path) -> Path:
    """Extract ``archive`` under ``into`` (once); return the folder to put on ``PYTHONPATH``."""
    root = into / archive.name.removesuffix(".tar.gz")
    if not (root / "megatron" / "core" / "__init__.py").exists():
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return root


def installed_has_mhc() -> bool:
    """The installed megatron-core has Megatron-LM main's mHC (checked without importing it)."""
    spec = importlib.util.find_spec("megatron")
    return spec is not None and any((Path(p) / MHC_MODULE.relative_to("megatron")).is_file()
                                    for p in spec.submodule_search_locations or ())


@dataclass(frozen=True)
class MainSource:
    """Where ``main``'s megatron comes from: a folder to put first on the path, an archive to
    extract, or nothing (the installed megatron-core has mHC)."""

    folder: Path | None = None
    archive: Path | None = None

    def describe(self) -> str:
        return str(self.folder or self.archive or "the installed megatron-core")


BRANCH_ENV = {"main": MAIN_ENV, "dev": "MHC_CG_MEGATRON_LM_DEV"}


def find_megatron(branch: str = "main") -> MainSource:
    """Where Megatron-LM ``branch``'s megatron.core comes from (see the module docstring; ``dev``
    has no installed form; ``core`` is the installed release, with mhc_cg's own layer);
    ``ConfigError`` (one line: what is missing, the fix) if absent."""
    if branch == "core":
        if importlib.util.find_spec("megatron") is None:
            raise ConfigError("megatron.branch: core runs the installed megatron-core, which is "
                              "not installed; pip install 'megatron-core==0.16.1'")
        return MainSource()
    env = BRANCH_ENV[branch]
    given = os.environ.get(env)
    if given:
        path = Path(given)
        if path.is_file() and path.name.endswith(".tar.gz"):
            return MainSource(archive=path)
        if (path / MHC_MODULE).is_file():
            return MainSource(folder=path)
        raise ConfigError(f"{env}={given}: neither a Megatron-LM checkout with "
                          f"{MHC_MODULE} nor a .tar.gz snapshot; point it at Megatron-LM {branch}")
    if branch == "main" and installed_has_mhc():
        return MainSource()
    archive = snapshot_archive(branch)
    if archive is not None:
        return MainSource(archive=archive)
    installed = "the installed megatron-core has no mHC and " if branch == "main" else ""
    raise ConfigError(
        f"Megatron-LM {branch}'s megatron.core (HyperConnectionTransformerLayer) not found: "
        f"{installed}no {archive_glob(branch)} is in "
        f"{' or '.join(str(d) for d in third_party_dirs())}; set {env} to a Megatron-LM {branch} "
        f"checkout (or its snapshot .tar.gz)")


def te_standin_for(device: str) -> Path | None:
    """The stand-in folder the child loads in place of TransformerEngine, or ``None`` for real TE
    (installed, on a GPU). Without TE the stand-in serves TE's graph API with TE's own
    ``make_graphed_callables`` from its wheel: over ``torch.cuda`` graphs on a GPU, over the tape
    on a CPU (:mod:`mhc_cg.lab.megatron_harness.te_on_tape`)."""
    if device == "cuda" and te_installed():
        return None
    return STANDIN_DIR


def load_te_standin(folder: str | Path) -> None:
    """In a child that has imported megatron: load the stand-in of ``folder`` (its
    ``__init__.py``, imported by path so that ``transformer_engine`` is not importable before
    megatron's modules are)."""
    path = Path(folder) / "__init__.py"
    spec = importlib.util.spec_from_file_location("te_on_tape_loader", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.load()


@contextmanager
def main_on_path(source: MainSource, scratch: Path | None = None) -> Iterator[list[Path]]:
    """The folders to put first on the child's ``PYTHONPATH`` (a snapshot extracted into
    ``scratch``, or a temporary folder removed afterwards)."""
    if source.archive is None:
        yield [p for p in (source.folder,) if p is not None]
        return
    if scratch is not None:
        yield [extract_snapshot(source.archive, scratch)]
        return
    with tempfile.TemporaryDirectory(prefix="mhc_cg_megatron_") as tmp:
        yield [extract_snapshot(source.archive, Path(tmp))]


def run_child(argv: list[str], first_on_path: list[Path], *, env: dict | None = None,
              forward_prefix: str | None = None, timeout: float | None = None) -> tuple[int, str]:
    """Run ``python argv`` with ``first_on_path`` then this repository first on ``PYTHONPATH``.

    Lines of the child's output that start with ``forward_prefix`` (its progress) go to this
    process's stderr as they come; returns ``(exit status, the child's other output)``. Without
    ``forward_prefix`` the child is killed after ``timeout`` seconds (``TimeoutExpired``).
    """
    child_env = _child_env(first_on_path, env)
    proc = subprocess.Popen([sys.executable, *argv], env=child_env, cwd=str(REPO), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        if forward_prefix is None:
            output, _ = proc.communicate(timeout=timeout)
            return proc.returncode, output
        kept = []
        for line in proc.stdout:  # as the child writes it
            if line.startswith(forward_prefix):
                sys.stderr.write(line)
                sys.stderr.flush()
            else:
                kept.append(line)
        return proc.wait(), "".join(kept)
    finally:
        if proc.poll() is None:  # a timeout, or this process interrupted
            proc.kill()
            proc.wait()


def run_ranks(argv: list[str], first_on_path: list[Path], world_size: int, *,
              env: dict | None = None, forward_rank: int = 0, forward_prefix: str | None = None,
              timeout: float | None = None) -> tuple[int, str]:
    """Run ``python argv RANK WORLD PORT`` once per rank, each with ``first_on_path`` first on
    ``PYTHONPATH`` (one process per rank; they meet on a local TCP port).

    Progress lines (``forward_prefix``) of rank ``forward_rank`` go to this process's stderr as
    they come. When a rank fails, the others are killed (they would wait on it forever).
    Returns ``(0, "")``, or ``(the failed rank's exit status, its output)``; after ``timeout``
    seconds every rank is killed and the status is ``-1``.
    """
    from mhc_cg.lab.pipeline.driver import free_port

    child_env = _child_env(first_on_path, env)
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="mhc_cg_ranks_") as logs:
        procs, files = [], []
        for rank in range(world_size):
            log_file = open(Path(logs, f"rank{rank}.log"), "w+")
            files.append(log_file)
            procs.append(subprocess.Popen([sys.executable, *argv, str(rank), str(world_size), port],
                                          env=child_env, cwd=str(REPO), text=True,
                                          stdout=log_file, stderr=subprocess.STDOUT))
        try:
            return _wait_for_ranks(procs, files, forward_rank, forward_prefix, timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log_file in files:
                log_file.close()


def _wait_for_ranks(procs, files, forward_rank: int, forward_prefix: str | None,
                    timeout: float | None) -> tuple[int, str]:
    start, forwarded = time.monotonic(), 0
    while True:
        if forward_prefix is not None:
            with open(files[forward_rank].name) as log_file:
                lines = log_file.read().splitlines(keepends=True)
            for line in lines[forwarded:]:
                if line.startswith(forward_prefix) and line.endswith("\n"):
                    sys.stderr.write(line)
                    sys.stderr.flush()
            forwarded = len(lines) - (0 if not lines or lines[-1].endswith("\n") else 1)
        failed = [(rank, p.returncode) for rank, p in enumerate(procs)
                  if p.poll() is not None and p.returncode != 0]
        if failed:
            rank, status = failed[0]
            return status, f"rank {rank}:\n{Path(files[rank].name).read_text()}"
        if all(p.poll() is not None for p in procs):
            return 0, ""
        if timeout is not None and time.monotonic() - start > timeout:
            return -1, "timed out; rank 0:\n" + Path(files[0].name).read_text()
        time.sleep(0.2)


def _child_env(first_on_path: list[Path], env: dict | None) -> dict:
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in first_on_path] + [str(REPO)]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    child_env["TORCH_COMPILE_DISABLE"] = "1"
    child_env["PYTHONWARNINGS"] = "ignore"  # megatron warns about missing TE/Apex on every import
    child_env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # megatron's sequence-parallel overlap wants it
    return child_env


def run_megatron_job(spec: dict, *, world_size: int = 1, forward_rank: int = 0,
                     progress_prefix: str | None = None, timeout: float | None = None) -> dict:
    """Run :mod:`mhc_cg.lab.megatron_harness.runs` on ``spec`` in ``world_size`` processes with
    Megatron-LM ``spec["branch"]`` first on the path; every rank's result (``RuntimeError`` with
    the failing rank's output if one fails)."""
    source = find_megatron(spec["branch"])
    standin = te_standin_for(spec["device"])
    env = {STANDIN_ENV: str(standin)} if standin is not None else {}
    with main_on_path(source) as first, tempfile.TemporaryDirectory(prefix="mhc_cg_job_") as tmp:
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps(spec))
        status, output = run_ranks(["-m", "mhc_cg.lab.megatron_harness.runs", str(spec_path), tmp],
                                   first, world_size, env=env, forward_rank=forward_rank,
                                   forward_prefix=progress_prefix, timeout=timeout)
        if status != 0:
            raise RuntimeError(f"the Megatron-LM {spec['branch']} process ({source.describe()}) "
                               f"failed with exit status {status}, {output[-6000:]}")
        return [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(world_size)]
