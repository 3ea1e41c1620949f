"""The training dtypes a config may name, and what each is in torch and in bytes."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TRAIN_DTYPES = tuple(TORCH_DTYPES)
DTYPE_BYTES = {name: torch.empty((), dtype=dt).element_size() for name, dt in TORCH_DTYPES.items()}
