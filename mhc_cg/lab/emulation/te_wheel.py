"""TransformerEngine's own Python, from its pure-Python wheel, where TE is not installed.

Note [TE's graph.py from its wheel]
-----------------------------------
``transformer-engine==2.20.2`` on PyPI has a pure-Python wheel (1.2 MB) holding
``transformer_engine/pytorch/graph.py``: TE's ``make_graphed_callables``. It is never
pip-installed (with only it installed, ``import transformer_engine`` raises RuntimeError instead
of ImportError, which breaks every ``try: import transformer_engine``, Megatron's among them).
:class:`TEWheel` runs TE's files straight from the zip instead:

1. No ``transformer_engine`` becomes importable for anyone else: each TE module gets a
   ``__import__`` of its own (:meth:`TEWheel.te_import`) that serves ``transformer_engine.*`` and
   ``transformer_engine_torch`` from this loader and everything else from Python's import, and
   is registered in ``sys.modules`` only under a private name (:data:`PRIVATE` + TE's name: its
   dataclasses look their module up there).
2. TE's files run as shipped, compiled from the wheel's bytes with the wheel's path as file name:
   ``make_graphed_callables.__code__.co_filename`` names the file in the wheel, whose sha256 the
   runs record (:func:`mhc_cg.graphs.te.source_of`). Packages are shells (their ``__init__.py`` loads
   TE's CUDA library and C extension), except ``transformer_engine.common``, which loads nothing
   with ``NVTE_PROJECT_BUILDING`` set.
3. Note [TE's files by their hashes]: every file of TE's that runs here, from the wheel or from a
   folder of its files (``MHC_CG_TE_WHEEL`` may name either, so a user's path decides what
   runs), is first checked against :data:`TE_FILE_SHA256`: the sha256 of TE 2.20.2's own files,
   read from the wheel PyPI publishes (whose sha256, :data:`TE_WHEEL_SHA256`, is its index's).
   A file of other content, or one outside the table, is refused by name before it runs, as
   pip's ``--require-hashes`` refuses an archive (:func:`verified`).
4. What needs TE's C extension is stood in for by :data:`STAND_INS`, the smallest set that
   ``graph.py`` and the real modules it imports (``quantization``, ``utils``, ``constants``,
   ``jit``, ``export``, ``fp8``) read: the three enums ``constants.py`` reads from the extension
   at import, classes that are only ``isinstance`` targets (TE's module, op and fuser bases: no
   module here is one), TE's RNG-state registry (four definitions of ``distributed.py``,
   compiled from its own source; the rest of that file imports TE's tensor tree), and the ONNX
   names ``export.py`` imports. A module outside both lists raises ImportError naming itself.

``graph.py``'s ``torch`` is the caller's: :meth:`TEWheel.graph_module` runs it once per graph
backend with ``torch.cuda`` served by that backend off a GPU
(:func:`mhc_cg.lab.emulation.cuda_api.torch_with`), or with torch itself on one.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import enum
import functools
import hashlib
import importlib.util
import os
import sys
import types
import zipfile
import zipimport
from pathlib import Path
from typing import Any

import torch

from mhc_cg.core.errors import ConfigError
from mhc_cg.graphs.capture import GraphBackend
from mhc_cg.graphs.te import TEGraph, installed_te, te_installed
from mhc_cg.lab.emulation.cuda_api import torch_with

TE_VERSION = "2.20.2"
TE_WHEEL = f"transformer_engine-{TE_VERSION}-py3-none-any.whl"
# where a TE wheel is looked for, after MHC_CG_TE_WHEEL (a .whl, or a folder holding one)
TE_PLACES = ("bench/carry/peers", ".cache/peers")
TE_ENV = "MHC_CG_TE_WHEEL"
ROOT = Path(__file__).resolve().parents[3]
GRAPH = "transformer_engine/pytorch/graph.py"
PRIVATE = "_mhc_cg_te_wheel."  # the prefix of the names TE's modules are registered under

# TE's files run as shipped (packages not listed are shells)
REAL = ("transformer_engine.common", "transformer_engine.common.recipe",
        "transformer_engine.pytorch.torch_version", "transformer_engine.pytorch.constants",
        "transformer_engine.pytorch.utils", "transformer_engine.pytorch.export",
        "transformer_engine.pytorch.jit", "transformer_engine.pytorch.quantization",
        "transformer_engine.pytorch.fp8", "transformer_engine.pytorch.graph")
# the four definitions of distributed.py the graph code reads (the rest needs the extension)
DISTRIBUTED = ("_ALL_ACTIVE_RNG_STATES", "get_all_rng_states", "set_all_rng_states",
               "graph_safe_rng_available")
ONNX = ("torch_onnx_gemm_inf_op", "onnx_quantize_fp8_op", "onnx_dequantize_fp8_op",
        "onnx_quantize_mxfp8_op", "onnx_dequantize_mxfp8_op", "onnx_layernorm",
        "onnx_attention_mask_func", "onnx_gemm", "te_translation_table")


# Note [TE's files by their hashes]: TE 2.20.2's wheel as PyPI's simple index lists it, and the
# sha256 of each of its files that runs here (graph.py and what it imports; the peers' mHC files)
TE_WHEEL_SHA256 = "7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094"
TE_FILE_SHA256 = {
    "transformer_engine/common/__init__.py":
        "6e383d171b4d580f558f0de81013535b34e99b08997ea4c1dadffd7d496a28cb",
    "transformer_engine/common/recipe/__init__.py":
        "66fb914a07d59fd2e1ba7b57240ef4b48c7f9b28060feb216fcc521946f8168e",
    "transformer_engine/common/triton/mhc.py":
        "0045990824e46034a2d3162a4690fec1fa87f880dbbab0f43c546ba29d62ff7f",
    "transformer_engine/pytorch/constants.py":
        "711b3e29036c778757cc23354c1c2449c942948141bace9ea1b490cb4275793c",
    "transformer_engine/pytorch/distributed.py":
        "d157ec4affa81d8b4fbcb58a307919ab758edad1330d53063b16b8dbdc838173",
    "transformer_engine/pytorch/export.py":
        "ff2b7eb9845fe3c1ecd7bee407e70fc8c1096cf52d5c2513888b92ebbf6a68cb",
    "transformer_engine/pytorch/fp8.py":
        "54a2967ad103ddcffcaf7a1d10e7d9fcfa3a290772d9239c416fff391349f3a1",
    "transformer_engine/pytorch/graph.py":
        "8f795d0be87618100ab5b3c6bbb9d11bb1958c3428807ec656b62da5c89209b6",
    "transformer_engine/pytorch/jit.py":
        "74b7237a2110bcfd3fbcda0013414443d7aa794eaf4bae888552c51d56b26369",
    "transformer_engine/pytorch/quantization.py":
        "ca1b03a90681d6d40cdc5b2b76d1b7fd51ab48a3ea12fa7158530f373fc6bb5f",
    "transformer_engine/pytorch/torch_version.py":
        "b5017c9599988e6851afcdc20f8ce8be250f41aed621e0aa2407dfaef8eb8b76",
    "transformer_engine/pytorch/triton/mhc.py":
        "4e71eff5d727625ef188e5ec86c2f91b25baf3742b7798313372b2a022e886da",
    "transformer_engine/pytorch/utils.py":
        "d9fc19bb9c12da8a47067fe8897be783e42bf5f60e2d5e0ccf3b1384049c47be",
}


def verified(member: str, data: bytes, where: Path | str) -> bytes:
    """``data``, TE's file ``member`` read from ``where``, if it is TE 2.20.2's own
    (Note [TE's files by their hashes]); else ``ConfigError`` naming the file and the fix."""
    fix = (f"use TransformerEngine {TE_VERSION}'s wheel as PyPI publishes it: pip download "
           f"--no-deps transformer-engine=={TE_VERSION} -d .cache/peers (sha256 "
           f"{TE_WHEEL_SHA256[:12]}...), and never edit its files")
    want = TE_FILE_SHA256.get(member)
    if want is None:
        raise ConfigError(f"{TE_ENV}: {where}: {member} is none of TransformerEngine "
                          f"{TE_VERSION}'s files mhc_cg runs; {fix}")
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise ConfigError(f"{TE_ENV}: {where}/{member} is not TransformerEngine {TE_VERSION}'s "
                          f"(sha256 {got[:12]}..., expected {want[:12]}...); refused before it "
                          f"runs; {fix}")
    return data


def find_te_wheel(repo: Path = ROOT) -> Path | None:
    """TE's wheel (or, for the peers' kernels, a folder holding its mHC files):
    ``$MHC_CG_TE_WHEEL``, then :data:`TE_PLACES` under ``repo``."""
    given = os.environ.get(TE_ENV)
    places = [Path(given)] if given else [repo / p for p in TE_PLACES]
    for place in places:
        if place.is_file():
            return place
        if (place / "transformer_engine").is_dir():
            return place
        if place.is_dir():
            wheels = sorted(place.glob("transformer_engine-*-py3-none-any.whl"))
            if wheels:
                return wheels[-1]
    return None


def te_missing_reason(repo: Path = ROOT) -> str:
    where = os.environ.get(TE_ENV) or " or ".join(str(repo / p) for p in TE_PLACES)
    return (f"no TransformerEngine {TE_VERSION} wheel in {where}: pip download --no-deps "
            f"transformer-engine=={TE_VERSION} -d .cache/peers (1.2 MB; never pip install it)")


# ---- the stand-ins ---------------------------------------------------------------------------

class TransformerEngineBaseModule(torch.nn.Module):
    """``isinstance`` target of TE's graph code: no module here is a TE module."""


class BasicOperation(torch.nn.Module):
    """``isinstance`` target (TE's ``ops`` basic operation)."""


class Sequential(torch.nn.Module):
    """``isinstance`` target (TE's ``ops.Sequential``)."""

    _module_groups = None


class OperationFuser:
    """``isinstance`` target (TE's ``ops`` fuser)."""

    _basic_ops = ()


class LinearAttentionBase(torch.nn.Module):
    """``isinstance`` target (imported by ``_make_graphed_callables`` at every call)."""


class DebugQuantizedTensor:
    """``isinstance`` target (TE's ``utils.py`` imports it at import)."""


def _extension() -> types.ModuleType:
    """``transformer_engine_torch``: the enums ``constants.py`` reads at import (their members as
    TE's C++ declares them; only their distinctness is used off FP8)."""
    tex = types.ModuleType("transformer_engine_torch", "stand-in for TE's C extension")
    tex.DType = enum.IntEnum("DType", "kByte kInt32 kFloat32 kFloat16 kBFloat16 kFloat8E4M3 "
                                      "kFloat8E5M2 kFloat4E2M1", start=0)
    tex.FP8FwdTensors = enum.IntEnum("FP8FwdTensors", "GEMM1_INPUT GEMM1_WEIGHT GEMM1_OUTPUT "
                                     "GEMM2_INPUT GEMM2_WEIGHT GEMM2_OUTPUT GEMM3_INPUT "
                                     "GEMM3_WEIGHT GEMM3_OUTPUT", start=0)
    tex.FP8BwdTensors = enum.IntEnum("FP8BwdTensors", "GRAD_OUTPUT1 GRAD_INPUT1 GRAD_OUTPUT2 "
                                     "GRAD_INPUT2 GRAD_OUTPUT3 GRAD_INPUT3", start=0)
    return tex


STAND_INS: dict[str, dict[str, Any]] = {
    "transformer_engine_torch": {},  # made by _extension
    "transformer_engine.pytorch.module.base": {
        "TransformerEngineBaseModule": TransformerEngineBaseModule},
    "transformer_engine.pytorch.ops": {"Sequential": Sequential},
    "transformer_engine.pytorch.ops.op": {"BasicOperation": BasicOperation},
    "transformer_engine.pytorch.ops.fuser": {"OperationFuser": OperationFuser},
    "transformer_engine.pytorch.attention.linear_attention.base": {
        "LinearAttentionBase": LinearAttentionBase},
    "transformer_engine.debug.pytorch.debug_quantization": {
        "DebugQuantizedTensor": DebugQuantizedTensor},
    "transformer_engine.pytorch.onnx_extensions": {name: None for name in ONNX},
    "transformer_engine.pytorch.distributed": {},  # DISTRIBUTED, from its own source
}


# ---- the loader ------------------------------------------------------------------------------

class TEWheel:
    """TE's Python from ``wheel`` (Note [TE's graph.py from its wheel]); ``version`` is the
    wheel's own."""

    def __init__(self, wheel: Path):
        self.wheel = Path(wheel).resolve()
        self.zip = zipfile.ZipFile(self.wheel)
        self.names = set(self.zip.namelist())
        self.loader = zipimport.zipimporter(str(self.wheel))  # tracebacks show TE's lines
        self.modules: dict[str, types.ModuleType] = {}
        self.version = self._version()
        if self.version != TE_VERSION:
            raise ConfigError(f"{TE_ENV}: {self.wheel} is TransformerEngine {self.version}; "
                              f"mhc_cg runs {TE_VERSION}'s files, checked by their hashes: "
                              f"pip download --no-deps transformer-engine=={TE_VERSION} "
                              f"-d .cache/peers")
        self.builtins = {**builtins.__dict__, "__import__": self.te_import}

    def _version(self) -> str:
        meta = next(n for n in self.names if n.endswith(".dist-info/METADATA"))
        for line in self.zip.read(meta).decode().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
        raise ValueError(f"{self.wheel}: no Version in {meta}")

    # -- import ---------------------------------------------------------------------------------
    def te_import(self, name: str, globals=None, locals=None, fromlist=(), level: int = 0):
        """``__import__`` for TE's modules: TE's names from here, the rest from Python."""
        if level:
            name = importlib.util.resolve_name("." * level + name, globals["__package__"])
        if not name.startswith("transformer_engine"):
            return builtins.__import__(name, globals, locals, fromlist, 0)
        module = self.load(name)
        if not fromlist:
            return self.load(name.split(".")[0])
        for item in fromlist:
            if item != "*" and not hasattr(module, item) and self._exists(f"{name}.{item}"):
                self.load(f"{name}.{item}")
        return module

    def _path(self, name: str) -> str:
        return name.replace(".", "/")

    def _exists(self, name: str) -> bool:
        path = self._path(name)
        return name in STAND_INS or f"{path}.py" in self.names or f"{path}/__init__.py" in self.names

    def load(self, name: str) -> types.ModuleType:
        """TE's module ``name``: a stand-in, a package shell or TE's own file."""
        if name in self.modules:
            return self.modules[name]
        parent, _, child = name.rpartition(".")
        path = self._path(name)
        package = f"{path}/__init__.py" in self.names
        module = types.ModuleType(PRIVATE + name)
        module.__package__ = name if package else parent
        module.__builtins__ = self.builtins
        if package:
            module.__path__ = [f"{self.wheel}/{path}"]
        self.modules[name] = module  # before running it: TE's modules import each other
        sys.modules[PRIVATE + name] = module
        try:
            if name == "transformer_engine_torch":
                module.__dict__.update(_extension().__dict__, __builtins__=self.builtins)
            elif name == "transformer_engine.pytorch.distributed":
                self._run_definitions(module, f"{path}.py", DISTRIBUTED)
            elif name in STAND_INS:
                module.__file__ = f"<stand-in for {name}>"
                module.__dict__.update(STAND_INS[name])
            elif name in REAL:
                self._run(module, f"{path}/__init__.py" if package else f"{path}.py")
            elif not package:
                raise ImportError(f"{name}: a TransformerEngine module that needs TE's C "
                                  f"extension; only what its graph code reads is loaded from the "
                                  f"wheel (mhc_cg.lab.emulation.te_wheel.REAL, STAND_INS)")
        except BaseException:
            del self.modules[name]
            del sys.modules[PRIVATE + name]
            raise
        if parent:
            setattr(self.load(parent), child, module)
        return module

    def _read(self, member: str) -> bytes:
        """TE's file ``member`` from the wheel, checked against its hash."""
        return verified(member, self.zip.read(member), self.wheel)

    def _compile(self, member: str, source: bytes | str) -> types.CodeType:
        return compile(source, f"{self.wheel}/{member}", "exec", dont_inherit=True)

    def _run(self, module: types.ModuleType, member: str, **globals_: Any) -> None:
        module.__file__ = f"{self.wheel}/{member}"
        module.__loader__ = self.loader
        module.__dict__.update(globals_)
        with _project_building():
            exec(self._compile(member, self._read(member)), module.__dict__)

    def _run_definitions(self, module: types.ModuleType, member: str, names: tuple) -> None:
        """Only ``names`` (top-level definitions) of TE's file ``member``, from its own source."""
        tree = ast.parse(self._read(member), member)
        keep = [node for node in tree.body
                if (isinstance(node, ast.ImportFrom) and node.module in ("__future__", "typing"))
                or (isinstance(node, ast.Import) and [a.name for a in node.names] == ["torch"])
                or (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names)
                or (isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id in names for t in node.targets))]
        module.__file__ = f"{self.wheel}/{member}"
        module.__loader__ = self.loader
        exec(self._compile(member, ast.Module(body=keep, type_ignores=[])), module.__dict__)
        missing = [n for n in names if n not in module.__dict__]
        if missing:
            raise ImportError(f"{member}: no top-level {missing} in this TransformerEngine")

    # -- the graph code -------------------------------------------------------------------------
    def graph_module(self, torch_module: types.ModuleType | None = None) -> types.ModuleType:
        """TE's ``graph.py`` run anew with ``torch_module`` as its ``torch`` (default: torch), its
        ``torch._C._graph_pool_handle`` that module's ``cuda.graph_pool_handle``."""
        module = types.ModuleType(PRIVATE + "transformer_engine.pytorch.graph")
        module.__package__ = "transformer_engine.pytorch"
        module.__builtins__ = self.builtins
        self._run(module, GRAPH)
        if torch_module is not None:
            module.torch = torch_module
            module._graph_pool_handle = torch_module.cuda.graph_pool_handle
            for name in ("utils", "quantization", "distributed"):  # what graph.py calls into
                self.load(f"transformer_engine.pytorch.{name}").torch = torch_module
        return module


@contextlib.contextmanager
def _project_building():
    """``transformer_engine.common`` loads TE's CUDA library unless ``NVTE_PROJECT_BUILDING`` is
    set: set while TE's files run here."""
    previous = os.environ.get("NVTE_PROJECT_BUILDING")
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["NVTE_PROJECT_BUILDING"]
        else:
            os.environ["NVTE_PROJECT_BUILDING"] = previous


@functools.cache
def te_wheel(path: str) -> TEWheel:
    """The loader of the wheel at ``path``, one per process (TE's modules keep state of their own,
    FP8's and the RNG registry, as an import would)."""
    return TEWheel(Path(path))


def te_graph(backend: GraphBackend) -> TEGraph:
    """TE's ``graph.py`` capturing on ``backend``: the installed TE's on CUDA, else the wheel's
    (its ``torch.cuda`` served by ``backend`` off a GPU). Raises ValueError, saying how to get
    it, where neither is at hand."""
    if backend.name == "cuda" and te_installed():
        return installed_te()
    wheel = find_te_wheel()
    if wheel is None or not wheel.is_file():
        raise ValueError(f"graph.backend 'te' needs TransformerEngine's Python: installed with "
                         f"its CUDA extension, or its wheel; {te_missing_reason()}")
    loaded = te_wheel(str(wheel))
    if backend.name == "cuda":
        return TEGraph(loaded.graph_module(None), "wheel", loaded.version)
    served = torch_with(backend)
    return TEGraph(loaded.graph_module(served), "wheel", loaded.version, served.cuda)
