"""A deterministic synthetic corpus that a tiny model learns in a few dozen steps.

Each sequence is an arithmetic progression modulo the vocabulary: a random start and a random
stride from a small set. After two tokens the rest is predictable, so the loss falls from
ln(vocab) towards (ln(vocab) + ln(len(strides))) / (seq - 1) as the model learns to read the stride.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhc_cg.config.choices import MIN_VOCAB_SIZE

STRIDES = (1, 2, 3, 5)


class ProgressionCorpus:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0):
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"ProgressionCorpus: vocab_size must be >= {MIN_VOCAB_SIZE}, got "
                             f"{vocab_size}")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """``(inputs [b, s], targets [b, s])``, targets shifted by one."""
        g = self.generator
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=g)
        stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (batch_size, 1), generator=g)]
        steps = torch.arange(self.seq_length + 1).unsqueeze(0)
        tokens = (start + stride * steps) % self.vocab_size
        return tokens[:, :-1], tokens[:, 1:]
