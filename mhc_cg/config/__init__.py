"""The run configuration: sections (:mod:`~mhc_cg.config.schema`), the values fields may take
(:mod:`~mhc_cg.config.choices`), every rule (:mod:`~mhc_cg.config.rules`) and YAML loading
(:mod:`~mhc_cg.config.load`). It stands on :mod:`mhc_cg.core` and on what its rules ask of
:mod:`mhc_cg.ops` (which dropout draws from a generator, the kernel choices); the model and the
runtime import it, never the reverse."""

from mhc_cg.config.load import load_config
from mhc_cg.config.rules import check
from mhc_cg.config.schema import (GraphConfig, MHCGPTConfig, ParallelConfig, RunConfig,
                                  TrainConfig)

__all__ = ["GraphConfig", "MHCGPTConfig", "ParallelConfig", "RunConfig", "TrainConfig", "check",
           "load_config"]
