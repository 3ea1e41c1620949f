"""The FP8 state TE keeps; the stand-in never enables FP8."""


class FP8GlobalStateManager:
    """Answers as TE does with FP8 off."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None
