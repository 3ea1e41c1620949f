"""The house's shape, checked: the product apart from the lab, packages by role with dependencies
one way, no import cycle, short functions, and a mode defined in one place that every tool picks
up."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Iterable

import pytest

from mhc_cg.cli import main
from mhc_cg.config import RunConfig
from mhc_cg.lab.references.eager import EagerModel
from mhc_cg.lab.registry import MODES, register, unregister
from mhc_cg.training.run import Mode
from mhc_cg.lab.compare.modes import run_modes, mismatches
from mhc_cg.lab.cost.report import cost_report
from mhc_cg.lab.resolve import train_config

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mhc_cg", "megatron_integration")
# lower layers never import higher ones. The product: basics <- ops <- config <- model <- graph
# capture <- eager block recompute <- the static runtime <- modes <- training (and the megatron
# glue); then the lab, which measures and emulates it; then the commands
LAYERS = {"mhc_cg.core": 0, "mhc_cg.ops": 1, "mhc_cg.config": 2, "mhc_cg.model": 3,
          "mhc_cg.graphs": 4, "mhc_cg.recompute": 5, "mhc_cg.runtime": 6, "mhc_cg.modes": 7,
          "mhc_cg.training": 8, "megatron_integration": 8,
          "mhc_cg.lab": 9,
          "mhc_cg.commands": 10, "mhc_cg.cli": 10, "mhc_cg.__main__": 10}
PRODUCT = tuple(p for p, rank in LAYERS.items() if rank < LAYERS["mhc_cg.lab"])
# inside the lab, sub-layers: a lab package imports only lab packages on a lower one.
# 0: the CPU stand-ins (the tape, torch.cuda over a backend, TE's wheel), the reference modes and
# the readers on the product alone (activation memory, traces); 1: every mode, in one registry;
# 2: a run resolved from it; 3: what builds on a run (the pipeline driver, the cost model) or on
# a model (the schedule planner on the memory model); 4: the comparisons and the Megatron
# harness; 5: the benches, which run and time it all.
LAB_LAYERS = {"mhc_cg.lab.emulation": 0, "mhc_cg.lab.references": 0, "mhc_cg.lab.memory": 0,
              "mhc_cg.lab.profiling": 0, "mhc_cg.lab.registry": 1, "mhc_cg.lab.resolve": 2,
              "mhc_cg.lab.pipeline": 3, "mhc_cg.lab.cost": 3, "mhc_cg.lab.planning": 3,
              "mhc_cg.lab.compare": 4, "mhc_cg.lab.megatron_harness": 4,
              "mhc_cg.lab.benchmarks": 5}
LAB = tuple(LAB_LAYERS)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(name: str, source: str, mods: Iterable[str], is_package: bool) -> set[str]:
    """The project modules (of ``mods``) that module ``name`` imports, anywhere in its source:
    at the top, inside functions (lazy imports) and in ``if TYPE_CHECKING:`` blocks (a type-only
    import is a turn-back too); ``from package import submodule`` counts as the submodule."""
    mods = set(mods)

    def owner(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    edges = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[:len(name.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]
        else:
            continue
        edges |= {owner(t) for t in targets if owner(t) not in (None, name)}
    return edges


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (:func:`imported_modules`: lazy and type-only
    imports included); ``from package import submodule`` edges to the package itself are not
    counted."""
    mods = modules()
    return {name: imported_modules(name, path.read_text(), mods, path.name == "__init__.py")
            for name, path in mods.items()}


def package_graph(graph: dict[str, set[str]], packages: Iterable[str]) -> dict[str, set[str]]:
    """``graph`` folded onto ``packages``: package -> the other packages its modules import
    (modules outside every package are left out)."""
    packages = sorted(packages, key=len, reverse=True)

    def package_of(module: str) -> str | None:
        return next((p for p in packages if module == p or module.startswith(p + ".")), None)

    folded: dict[str, set[str]] = {p: set() for p in packages}
    for module, targets in graph.items():
        here = package_of(module)
        if here is not None:
            folded[here] |= {p for p in map(package_of, targets) if p not in (None, here)}
    return folded


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` closes, each as the path that closes it."""
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def layer_of(name: str) -> int | None:
    return next((rank for prefix, rank in sorted(LAYERS.items(), key=lambda kv: -len(kv[0]))
                 if name == prefix or name.startswith(prefix + ".")), None)


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, cycles


def test_no_import_loop_among_the_tool_packages():
    """Module by module there is no cycle; package by package there is none among the tools
    either (lazy imports count: a function that imports a tool ties its package to that tool)."""
    cycles = find_cycles(package_graph(import_graph(), LAB))
    assert not cycles, cycles


def test_the_package_loop_check_sees_a_loop_no_module_cycle_shows():
    """Two packages importing each other through different modules: no module cycle, a package
    loop; and an import inside a function is an edge like one at the top."""
    lazy = "def f():\n    from tools_b.y import g\n"
    mods = ("tools_a", "tools_a.x", "tools_a.z", "tools_b", "tools_b.y")
    graph = {"tools_a.x": imported_modules("tools_a.x", lazy, mods, False),
             "tools_b.y": {"tools_a.z"}, "tools_a.z": set()}
    assert graph["tools_a.x"] == {"tools_b.y"}
    assert find_cycles(graph) == []
    assert find_cycles(package_graph(graph, ("tools_a", "tools_b"))) == \
        [["tools_a", "tools_b", "tools_a"]]


def test_the_lab_imports_only_lab_parts_on_a_lower_sub_layer():
    """Every part of the lab has its sub-layer, and imports only parts below it."""
    parts = {f"mhc_cg.lab.{p.stem}" for p in (ROOT / "mhc_cg" / "lab").iterdir()
             if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert set(LAB_LAYERS) == parts, parts ^ set(LAB_LAYERS)
    upward = sorted((a, b) for a, targets in package_graph(import_graph(), LAB).items()
                    for b in targets if LAB_LAYERS[b] >= LAB_LAYERS[a])
    assert not upward, upward


def product_imports_of_the_lab(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(product module, lab module)`` for every import of the lab from the product (lazy and
    type-only imports included: :func:`imported_modules`)."""
    def in_product(name: str) -> bool:
        return name.startswith(tuple(f"{p}." for p in PRODUCT)) or name in PRODUCT

    return sorted((a, b) for a, targets in graph.items() if in_product(a)
                  for b in targets if b == "mhc_cg.lab" or b.startswith("mhc_cg.lab."))


def test_the_product_imports_nothing_of_the_lab():
    """What a user imports to train (ops and kernels, the model, graph capture, eager and static
    recompute, the modes, training, megatron_integration) never imports the lab: the references
    it is measured against, the CPU stand-ins, the tools. The check sees a lazy import."""
    assert product_imports_of_the_lab(import_graph()) == []
    lazy = "def f():\n    from mhc_cg.lab.emulation.tape import TapeBackend\n"
    mods = ("mhc_cg.runtime.toy", "mhc_cg.lab.emulation.tape")
    graph = {"mhc_cg.runtime.toy": imported_modules("mhc_cg.runtime.toy", lazy, mods, False)}
    assert product_imports_of_the_lab(graph) == [("mhc_cg.runtime.toy",
                                                   "mhc_cg.lab.emulation.tape")]


def test_dependencies_run_one_way():
    upward = [(a, b) for a, targets in import_graph().items() for b in targets
              if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]
    assert not upward, upward


def test_no_back_pointer_and_no_module_state_in_the_runtime():
    """The static runtime hands its strategies what they read (no ``.rt = self``); the runtime
    keeps no ``global`` state; its recompute, graphs and the model ask no config rule; the
    Megatron package holds what users import (the harness lives in the lab)."""
    runtime = [p for name, p in modules().items() if name.startswith("mhc_cg.runtime.")]
    assert not [str(p) for p in modules().values() if ".rt = " in p.read_text()]
    assert not [str(p) for p in runtime
                if any(line.lstrip().startswith("global ") for line in p.read_text().splitlines())]
    graph = import_graph()
    asks = [name for name, targets in graph.items()
            if name.startswith(("mhc_cg.runtime", "mhc_cg.recompute", "mhc_cg.graphs",
                                "mhc_cg.model"))
            and "mhc_cg.config.rules" in targets]
    assert not asks, asks
    assert not (ROOT / "megatron_integration" / "harness").exists()
    assert not [name for name, targets in graph.items() if name.startswith("megatron_integration")
                and any(t.startswith("mhc_cg.lab") for t in targets)]


def test_every_module_has_a_role():
    loose = [name for name in modules() if name.count(".") == 1 and name.startswith("mhc_cg.")
             and layer_of(name) is None]
    assert len(loose) <= 3, loose  # besides __init__, __main__ and cli
    assert all(layer_of(name) is not None for name in modules() if name != "mhc_cg"), \
        [name for name in modules() if name != "mhc_cg" and layer_of(name) is None]


def test_no_function_over_80_lines():
    long = [(str(path.relative_to(ROOT)), node.name, node.end_lineno - node.lineno + 1)
            for path in modules().values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long


def test_a_mode_name_is_spelled_in_at_most_five_modules():
    spelled = {name for name, path in modules().items()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and node.value in MODES}
    assert len(spelled) <= 5, sorted(spelled)


TINY = {"model": {"vocab_size": 16, "seq_length": 8, "hidden_size": 16, "num_heads": 2,
                  "num_layers": 2, "num_streams": 4, "hidden_dropout": 0.1,
                  "recompute": "block", "recompute_layers": 1},
        "train": {"steps": 2, "micro_batch_size": 2, "device": "cpu"},
        "graph": {"backend": "auto", "cuda_graph_scope": ["attn", "mhc_recompute"]}}


@pytest.fixture
def toy_mode():
    """A mode registered in one place: eager without recompute, under its own name."""
    mode = register(Mode("toy_eager", "eager, no recompute, registered by a test", EagerModel,
                         recompute_activation=False))
    yield mode
    unregister(mode.name)


def test_a_toy_mode_registered_in_one_place_reaches_train_compare_and_cost(toy_mode, tmp_path,
                                                                          capsys):
    cfg = RunConfig.from_dict(TINY)
    assert train_config(cfg, mode="toy_eager", progress=False).losses == \
        train_config(cfg, mode="eager_none", progress=False).losses
    results = run_modes(cfg, progress=False)
    assert "toy_eager" in results and not mismatches(results)
    assert "toy_eager" in cost_report(cfg, "meta")["modes"]
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps(TINY))  # JSON is YAML
    assert main(["train", "--config", str(path), "--mode", "toy_eager", "--json",
                 "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "toy_eager"


def test_the_step_loop_is_written_once_and_no_mode_runs_a_backward_itself():
    """The microbatch loop lives in one function (``microbatch_loop``, in training): the session
    runs it and a full-iteration mode captures it, given at prepare; a mode backpropagates only
    in that loop, never by calling ``.backward(`` itself."""
    modes = [*(ROOT / "mhc_cg" / "modes").glob("*.py"),
             *(ROOT / "mhc_cg" / "lab" / "references").glob("*.py")]
    calls = [f"{p.name}:{n}" for p in modes
             for n, line in enumerate(p.read_text().splitlines(), 1) if ".backward(" in line]
    assert calls == []
    users = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mhc_cg").rglob("*.py")
             if "microbatch_loop(" in p.read_text()}
    # the session runs it; a full-iteration mode is made with it
    assert users == {"mhc_cg/training/session.py"}


# -- state passed, not ambient -------------------------------------------------------------------

def context_variable_uses(sources: dict[str, str]) -> list[str]:
    """``name:line`` of every ``contextvars`` import and every ``ContextVar`` named in ``sources``
    (module name -> text)."""
    found = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            imported = (isinstance(node, ast.Import)
                        and any(a.name == "contextvars" for a in node.names)
                        or isinstance(node, ast.ImportFrom) and node.module == "contextvars")
            named = (isinstance(node, ast.Name) and node.id == "ContextVar"
                     or isinstance(node, ast.Attribute) and node.attr == "ContextVar")
            if imported or named:
                found.append(f"{name}:{node.lineno}")
    return found


def test_no_context_variable_carries_state_beside_the_calls():
    """What a step needs travels as arguments (the persistent set, the scratch, F's output
    buffer, the logits' memory): no context variable anywhere in the product."""
    assert context_variable_uses({n: p.read_text() for n, p in modules().items()}) == []
    toy = "import contextvars\nSCRATCH = contextvars.ContextVar('scratch', default=None)\n"
    assert context_variable_uses({"toy": toy}) == ["toy:1", "toy:2"]


class TensorAttributes:
    """Every attribute a project module sets on a tensor (``t.name = value`` or ``setattr``)
    that torch does not define (``data``, ``grad`` and ``requires_grad`` are torch's API):
    ``(file, name)`` in ``found``, while ``torch.Tensor.__setattr__`` notes the caller."""

    def __init__(self):
        self.found: set[tuple[str, str]] = set()

    def __enter__(self) -> "TensorAttributes":
        import sys

        import torch

        found, roots = self.found, tuple(f"{ROOT / package}/" for package in PACKAGES)

        def record(tensor, name, value):
            if not hasattr(type(tensor), name):
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(roots):
                    found.add((Path(caller).relative_to(ROOT).as_posix(), name))
            object.__setattr__(tensor, name, value)

        torch.Tensor.__setattr__ = record
        return self

    def __exit__(self, *exc) -> None:
        import torch

        del torch.Tensor.__setattr__


def test_the_tensor_attribute_check_sees_both_spellings_and_leaves_torchs_own_alone():
    import torch

    toy = "t.flag = True\nsetattr(t, 'note', 1)\nt.requires_grad = True\nt.grad = t.clone()\n"
    with TensorAttributes() as seen:
        exec(compile(toy, str(ROOT / "mhc_cg" / "toy.py"), "exec"), {"t": torch.zeros(2)})
    assert seen.found == {("mhc_cg/toy.py", "flag"), ("mhc_cg/toy.py", "note")}
    assert "__setattr__" not in torch.Tensor.__dict__


# a training step calls down this order, never up (callbacks that reach back are closures handed
# down; the modes hand the runtime data and graphed callables instead)
# (the lab's CPU stand-in for a graph's replay stands where the graph does, its reference modes
# where the product's modes do: a step calls them through those interfaces)
STEP_LAYERS = {"mhc_cg.core": 0, "mhc_cg.ops": 1, "mhc_cg.config": 2, "mhc_cg.model": 3,
               "mhc_cg.graphs": 4, "mhc_cg.lab.emulation": 4, "mhc_cg.recompute": 5,
               "mhc_cg.runtime": 6, "mhc_cg.modes": 7, "mhc_cg.lab.references": 7,
               "mhc_cg.training": 8}


def step_layer_of(name: str) -> int | None:
    return next((rank for prefix, rank in sorted(STEP_LAYERS.items(), key=lambda kv: -len(kv[0]))
                 if name == prefix or name.startswith(prefix + ".")), None)


def handed_down(frame) -> bool:
    """Whether the function running in ``frame`` was handed to its caller: it, or the object it
    is a method of, is one of the caller's locals or an attribute of one (a callback such as a
    checkpoint's ``fn`` or an overridden method, which a lower layer runs without importing)."""
    code, back = frame.f_code, frame.f_back
    owner = frame.f_locals.get("self") if code.co_argcount else None

    def runs_it(value) -> bool:
        func = getattr(value, "__func__", value)
        return getattr(func, "__code__", None) is code or (owner is not None and value is owner)

    held = list(back.f_locals.values())
    held += [v for obj in held if hasattr(obj, "__dict__") for v in vars(obj).values()]
    return any(runs_it(v) for v in held)


def upward_calls_in_a_step(session) -> set[tuple[str, str]]:
    """``(caller module.function, callee module.function)`` of every Python call, from one
    mhc_cg module into another, that goes up :data:`STEP_LAYERS` other than into a callback the
    caller was handed, or into a module outside it (a tool), over one training step
    (``sys.setprofile``)."""
    import sys

    found = set()

    def profile(frame, event, arg):
        back = frame.f_back
        if event != "call" or back is None:
            return
        callee, caller = frame.f_globals.get("__name__", ""), back.f_globals.get("__name__", "")
        if not (callee.startswith("mhc_cg.") and caller.startswith("mhc_cg.")):
            return
        low, high = step_layer_of(caller), step_layer_of(callee)
        if high is None or (low is not None and high > low and not handed_down(frame)):
            found.add((f"{caller}.{back.f_code.co_name}", f"{callee}.{frame.f_code.co_name}"))

    sys.setprofile(profile)
    try:
        session.step()
    finally:
        sys.setprofile(None)
    return found


# what a run may write at module level (docs/design.md, item 17): the registers of what a GPU run
# keeps in device memory, which the tape reads to tell a 0-dim device tensor from a CPU scalar,
# and NVTX's memo of the names it registered (a string is registered once per process)
PROCESS_WIDE = {"mhc_cg.graphs.static_inputs._STATIC_BUFFERS",
                "mhc_cg.lab.emulation.tape._CAPTURED", "mhc_cg.core.nvtx._attributes"}


def module_state() -> dict[str, object]:
    """What every loaded project module holds at module level, and its classes in their own
    attributes, as identities: a global's object, and a container's (list, dict, set, their weak
    kinds) entries, or a counter's next value. Rebinding a global, or adding to or taking from a
    module's or a class's container, changes it."""
    import collections
    import itertools
    import sys
    import types
    import weakref

    from torch.utils.weak import WeakIdKeyDictionary

    containers = (list, dict, set, collections.deque, weakref.WeakSet, weakref.WeakKeyDictionary,
                  weakref.WeakValueDictionary, WeakIdKeyDictionary)

    def identity(value):
        if isinstance(value, itertools.count):
            return repr(value)
        if not isinstance(value, containers):
            return id(value)
        entries = list(value.items()) if hasattr(value, "items") else list(value)
        return id(value), tuple(id(x) for e in entries for x in (e if isinstance(e, tuple) else (e,)))

    state = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(PACKAGES):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                state.update({f"{name}.{attr}.{k}": identity(v) for k, v in list(vars(value).items())
                              if isinstance(v, (*containers, itertools.count))})
            elif not isinstance(value, (type, types.ModuleType, types.FunctionType,
                                        types.BuiltinFunctionType)):
                state[f"{name}.{attr}"] = identity(value)
    return state


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before.keys() & after.keys() if before[k] != after[k]}


def test_the_module_state_check_sees_a_rebound_global_and_a_container_written():
    import itertools
    import sys
    import types

    toy = types.ModuleType("mhc_cg.toy_state")
    toy.seen, toy.switch, toy.numbers = [], False, itertools.count()
    toy.Kept = type("Kept", (), {"__module__": toy.__name__, "active": []})
    sys.modules[toy.__name__] = toy
    try:
        before = module_state()
        toy.seen.append(object())
        toy.switch = True
        next(toy.numbers)
        toy.Kept.active.append(1)
        # the process-wide weak registers drop what an earlier test left as the collector frees it
        assert changed(before, module_state()) - PROCESS_WIDE == {
            f"mhc_cg.toy_state.{n}" for n in ("seen", "switch", "numbers", "Kept.active")}
    finally:
        del sys.modules[toy.__name__]


def test_the_step_probe_tells_an_upward_call_from_a_callback_handed_down():
    """Self-test: a lower layer's module calling a higher one's function by name is found; the
    same function handed to it as an argument, or as an object's method, is a callback."""
    low, high = {"__name__": "mhc_cg.recompute.probe"}, {"__name__": "mhc_cg.modes.probe"}
    exec("def work():\n    return 1\n"
         "class Part:\n    def __call__(self):\n        return 2\n", high)
    exec("def by_name():\n    return work()\n"
         "def handed(fn, part):\n    return fn() + part()\n", low)
    low["work"] = high["work"]

    class Step:
        def __init__(self, run):
            self.step = run

    assert upward_calls_in_a_step(Step(low["by_name"])) == {
        ("mhc_cg.recompute.probe.by_name", "mhc_cg.modes.probe.work")}
    assert upward_calls_in_a_step(
        Step(lambda: low["handed"](high["work"], high["Part"]()))) == set()


def test_a_training_step_of_every_mode_never_calls_upward_nor_marks_a_tensor():
    """Every mode on the tiny config, built (captures included) and stepped twice: no call
    from a product module into a higher layer and no tool module on the second step's path;
    no attribute set on a tensor to steer later code, anywhere from build to the last step; no
    module-level state written by a build or a step beyond the process-wide registers."""
    import torch

    from helpers import tiny_run_config
    from mhc_cg.lab.resolve import resolve
    from mhc_cg.training.session import TrainSession

    cfg = tiny_run_config()
    found, by_build, by_step = {}, {}, {}
    with TensorAttributes() as marks:
        for mode in MODES:
            before = module_state()
            session = TrainSession.build(resolve(cfg, mode, torch.device("cpu")))
            session.step()
            built = module_state()
            found[mode] = upward_calls_in_a_step(session)
            by_build[mode], by_step[mode] = changed(before, built) - PROCESS_WIDE, \
                changed(built, module_state()) - PROCESS_WIDE
    assert all(not calls for calls in found.values()), found
    assert marks.found == set()
    assert all(not c for c in (*by_build.values(), *by_step.values())), (by_build, by_step)


def files_a_step_runs(session) -> dict[str, set[str]]:
    """The project files whose code runs on the host in one training step (``sys.setprofile``),
    each with the functions of it that ran. A tape graph's replay counts as its file alone: what
    it replays is the device's work (a GPU's replay runs no Python)."""
    import sys

    from mhc_cg.lab.emulation.tape import TapeGraph

    replay, roots, inside, files = TapeGraph._replay.__code__, \
        tuple(f"{ROOT / package}/" for package in PACKAGES), [0], {}

    def profile(frame, event, arg):
        code = frame.f_code
        if code is replay and event in ("call", "return"):
            inside[0] += 1 if event == "call" else -1
        if event == "call" and (inside[0] == 0 or code is replay) \
                and code.co_filename.startswith(roots):
            name = Path(code.co_filename).relative_to(ROOT).as_posix()
            if not code.co_name.startswith("<"):  # comprehensions and lambdas: their function's
                files.setdefault(name, set()).add(code.co_qualname)
            files.setdefault(name, set())

    sys.setprofile(profile)
    try:
        session.step()
    finally:
        sys.setprofile(None)
    return dict(sorted(files.items()))


def test_one_graphed_static_step_runs_few_files(capsys):
    """A reader follows ``TrainSession.run_step`` down to the kernels: one graphed_static step
    (every sublayer and the recompute graphed) runs in 24 of our files, each one concept on
    the path (the session and its loop, data, optimizer; the mode and its lifecycle; the
    runtime, arena and sets; replay, its static inputs and lent grads, the graph and the tape;
    the model's embedding, head, final norm and loss; the kernels' wrappers, their choice of
    implementation, the registered ops and the torch reference; regions and their profiler half;
    storage identity). It prints each file with the functions of it that ran."""
    import torch

    from helpers import tiny_run_config
    from mhc_cg.lab.resolve import resolve
    from mhc_cg.training.session import TrainSession

    session = TrainSession.build(resolve(tiny_run_config(), "graphed_static", torch.device("cpu")))
    session.step()
    files = files_a_step_runs(session)
    with capsys.disabled():
        print(f"\none graphed_static step runs {len(files)} files:")
        for name, functions in files.items():
            print(f"  {name}: {', '.join(sorted(functions))}")
    assert "mhc_cg/runtime/static.py" in files and len(files) <= 24, files


def test_parts_by_role_no_file_name_twice_and_no_cost_table_under_ops():
    """The product's parts and the lab's are rooms named for what they are (no ``tools`` folder,
    and the lab a folder of rooms, not one): no room holds more than a third of the lines, no
    file name appears twice, and the cost model's per-op tables live with the cost model, not
    beside the ops."""
    root = ROOT / "mhc_cg"
    files = [p for p in root.rglob("*.py") if "te_on_tape" not in p.parts]
    lines = {}
    for p in files:
        parts = p.relative_to(root).parts
        part = "/".join(parts[:2]) if parts[0] == "lab" and len(parts) > 2 else parts[0]
        lines[part] = lines.get(part, 0) + len(p.read_text().splitlines())
    assert not (root / "tools").exists()
    assert max(lines.values()) < sum(lines.values()) / 3, lines
    names = [p.name for p in files if p.name != "__init__.py"]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)
    tables = ("LAUNCHES", "READ_TWICE", "NOT_MHC", "def scratch_bytes")
    assert not [p.name for p in (root / "ops").rglob("*.py")
                if any(t in p.read_text() for t in tables)]


# -- a training step does what training needs ---------------------------------------------------

def host_calls_in_training(cfg, mode: str, **hooks) -> set[str]:
    """The names of every C function (builtins and torch's bound methods) that ``train`` calls
    while its steps run (``sys.setprofile``'s ``c_call``): a gradient hashed on the host shows
    as the tensor's ``numpy`` and ``tobytes`` and the hash's ``hexdigest``."""
    import sys

    from mhc_cg.training import session as session_module

    seen: set[str] = set()
    step = session_module.TrainSession.step

    def watched_step(self, **kwargs):
        def profile(frame, event, arg):
            if event == "c_call":
                seen.add(getattr(arg, "__name__", ""))

        sys.setprofile(profile)
        try:
            return step(self, **kwargs)
        finally:
            sys.setprofile(None)

    session_module.TrainSession.step = watched_step
    try:
        train_config(cfg, mode=mode, steps=2, progress=False, **hooks)
    finally:
        session_module.TrainSession.step = step
    return seen


HOST_COPIES = {"numpy", "tobytes", "hexdigest"}


@pytest.mark.parametrize("mode", ["eager_none", "graphed_static"])
def test_a_plain_training_step_hashes_nothing_and_copies_no_gradient_to_the_host(mode):
    """``mhc-cg train`` without ``--compare``: its step makes no gradient digest and moves no
    gradient to the host; the comparison's hooks (which do) show up in the same probe."""
    import torch

    from helpers import tiny_run_config
    from mhc_cg.lab.compare.watch import StepWatch

    cfg = tiny_run_config()
    plain = host_calls_in_training(cfg, mode)
    assert not plain & HOST_COPIES, plain & HOST_COPIES
    watch = StepWatch(torch.device("cpu"))
    watched = host_calls_in_training(cfg, mode, after_backward=watch.after_backward,
                                     first_microbatch=watch.first_microbatch)
    assert HOST_COPIES <= watched and len(watch.grad_digests) == 2
    assert watch.held_bytes_per_microbatch is not None
