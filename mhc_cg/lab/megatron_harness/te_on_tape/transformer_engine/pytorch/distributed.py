"""TE's activation-recompute flag; off, since the stand-in has no FP8."""


def is_fp8_activation_recompute_enabled() -> bool:
    return False
