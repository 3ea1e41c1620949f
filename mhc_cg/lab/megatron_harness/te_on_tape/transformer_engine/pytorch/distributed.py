"""``transformer_engine.pytorch.distributed``: TE's activation-recompute flag (off: no FP8), and
its RNG tracker class, which needs TE's C extension's generators."""

import contextlib


def is_fp8_activation_recompute_enabled() -> bool:
    return False


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False,
                                 recompute_phase: bool = False):
    """TE's FP8 bookkeeping around a recomputed forward: nothing to keep without FP8."""
    yield


class CudaRNGStatesTracker:
    """``issubclass`` target of Megatron's ``TECudaRNGStatesTracker``."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("TE's CudaRNGStatesTracker is not served by the CPU stand-in "
                                  "of TransformerEngine; drop --te-rng-tracker")
