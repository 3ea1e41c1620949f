from mhc_cg.config.schema import *  # noqa
from mhc_cg.config.schema import load_config, RunConfig, TrainConfig, ParallelConfig, GraphConfig  # noqa
