"""TE's own Python for the ``transformer_engine`` stand-in: its wheel's files (``WHEEL``), and its
graph code capturing on this machine's primitive (``torch.cuda`` graphs on a GPU, the tape on a
CPU; ``GRAPH``)."""

from __future__ import annotations

from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.lab.emulation.te_wheel import find_te_wheel, te_graph, te_wheel

GRAPH = te_graph(get_backend("auto"))
WHEEL = te_wheel(str(find_te_wheel()))


def public(name: str) -> dict:
    """The public names of TE's module ``name``, from the wheel."""
    module = WHEEL.load(name)
    return {key: getattr(module, key) for key in dir(module) if not key.startswith("_")}
