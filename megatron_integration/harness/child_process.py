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
TransformerEngine, which installs only with CUDA: on a machine without a GPU the child loads
:mod:`megatron_integration.harness.te_on_tape` after megatron (TE's graph API on mhc_cg's tape,
FP8 refused); ``MHC_CG_TE_STANDIN`` names its folder for the child.
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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mhc_cg.core.errors import ConfigError
from mhc_cg.runtime.graphs.backends import te_available

# the folder that holds ``megatron_integration`` (a checkout, or site-packages)
REPO = Path(__file__).resolve().parents[2]


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


def find_main() -> MainSource:
    """See the module docstring; ``ConfigError`` (one line: what is missing, the fix) if absent."""
    given = os.environ.get(MAIN_ENV)
    if given:
        path = Path(given)
        if path.is_file() and path.name.endswith(".tar.gz"):
            return MainSource(archive=path)
        if (path / MHC_MODULE).is_file():
            return MainSource(folder=path)
        raise ConfigError(f"{MAIN_ENV}={given}: neither a Megatron-LM checkout with "
                          f"{MHC_MODULE} nor a .tar.gz snapshot; point it at Megatron-LM main")
    if installed_has_mhc():
        return MainSource()
    archive = snapshot_archive()
    if archive is not None:
        return MainSource(archive=archive)
    raise ConfigError(
        f"Megatron-LM main's megatron.core (HyperConnectionTransformerLayer) not found: the "
        f"installed megatron-core has no mHC and no {ARCHIVE_GLOB} is in "
        f"{' or '.join(str(d) for d in third_party_dirs())}; set {MAIN_ENV} to a Megatron-LM main "
        f"checkout (or its snapshot .tar.gz)")


def te_standin_for(device: str) -> Path | None:
    """The stand-in folder the child loads in place of TransformerEngine, or ``None`` for real TE."""
    if device == "cuda":
        if not te_available():
            raise ConfigError("train.device: cuda runs megatron's TECudaGraphHelper with "
                              "TransformerEngine, which is not installed; pip install "
                              "'transformer-engine[pytorch]', or set train.device: cpu")
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
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in first_on_path] + [str(REPO)]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    child_env["TORCH_COMPILE_DISABLE"] = "1"
    child_env["PYTHONWARNINGS"] = "ignore"  # megatron warns about missing TE/Apex on every import
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


def run_main_job(spec: dict, *, progress_prefix: str | None = None) -> dict:
    """Run ``megatron_integration.harness.main_runs`` on ``spec`` in a child with ``main`` first on the
    path; its result (``RuntimeError`` with the child's output if it fails)."""
    source = find_main()
    standin = te_standin_for(spec["device"])
    env = {STANDIN_ENV: str(standin)} if standin is not None else {}
    with main_on_path(source) as first, tempfile.TemporaryDirectory(prefix="mhc_cg_job_") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        status, output = run_child(["-m", "megatron_integration.harness.main_runs", str(spec_path),
                                    str(out_path)], first, env=env, forward_prefix=progress_prefix)
        if status != 0:
            raise RuntimeError(f"the Megatron-LM main process ({source.describe()}) failed with "
                               f"exit status {status}:\n{output[-6000:]}")
        return json.loads(out_path.read_text())
