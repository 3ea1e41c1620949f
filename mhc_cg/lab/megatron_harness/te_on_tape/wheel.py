"""TE's graph code for the ``transformer_engine`` stand-in: the wheel's, capturing on this
machine's primitive (``torch.cuda`` graphs on a GPU, the tape on a CPU)."""

from __future__ import annotations

from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.lab.emulation.te_wheel import te_graph

GRAPH = te_graph(get_backend("auto"))
