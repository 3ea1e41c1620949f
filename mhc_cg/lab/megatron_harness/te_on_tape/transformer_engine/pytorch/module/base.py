"""``transformer_engine.pytorch.module.base``: TE's module base class needs TE's C extension; the
class TE's graph code checks against stands in (no module here is a TE module)."""

from mhc_cg.lab.emulation.te_wheel import TransformerEngineBaseModule

__all__ = ["TransformerEngineBaseModule"]
