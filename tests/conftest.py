"""Suite-wide settings.

The models under test are tiny: one intra-op thread is several times faster than torch's default
on a small shared CI machine (thread spin-up dominates), and keeps timings steady under load.

Without a GPU, Triton kernels (``model.kernels: triton``, tests/test_kernels.py) run in Triton's
interpreter, which must be chosen before anything imports triton (torch itself may): hence here,
before the first test module is collected. Nothing else changes: ``kernels: auto`` stays torch on CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
