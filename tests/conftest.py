"""Suite-wide settings.

The models under test are tiny: one intra-op thread is several times faster than torch's default
on a small shared CI machine (thread spin-up dominates), and keeps timings steady under load.
"""

import torch

torch.set_num_threads(1)
