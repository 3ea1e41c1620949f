"""The tiny mHC GPT: shapes, errors, counter dropout, and that it learns."""

import pytest
import torch

from mhc_cg.config import RunConfig
from mhc_cg.ops.dropout import counter_dropout_mask, dropout
from mhc_cg.ops.kernels.hash import counter_bits
from mhc_cg.core.errors import ConfigError
from mhc_cg.model import MHCGPT, MHCGPTConfig
from mhc_cg.lab.resolve import train_config

TINY = dict(vocab_size=32, seq_length=8, hidden_size=16, num_heads=2, num_layers=2, num_streams=4)


def test_logits_shape_and_bad_input():
    model = MHCGPT(MHCGPTConfig(**TINY))
    assert model(torch.randint(0, 32, (3, 8))).shape == (3, 8, 32)
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        model(torch.randint(0, 32, (8,)))
    with pytest.raises(ValueError, match="seq_length=8"):
        model(torch.randint(0, 32, (1, 9)))


def test_config_errors_name_field_and_allowed_values():
    with pytest.raises(ConfigError, match="model.recompute: must be one of"):
        MHCGPTConfig(recompute="sometimes")
    with pytest.raises(ConfigError, match="model.num_heads: must divide hidden_size=16"):
        MHCGPTConfig(hidden_size=16, num_heads=3)


def test_counter_dropout_is_a_pure_function_of_seed_stream_and_index():
    seed = torch.tensor(1234)
    a = counter_dropout_mask(seed, 3, torch.Size([64, 64]), 0.25, torch.float32)
    b = counter_dropout_mask(seed.clone(), 3, torch.Size([64, 64]), 0.25, torch.float32)
    assert torch.equal(a, b)
    assert not torch.equal(a, counter_dropout_mask(seed, 4, torch.Size([64, 64]), 0.25, torch.float32))
    assert not torch.equal(a, counter_dropout_mask(seed + 1, 3, torch.Size([64, 64]), 0.25, torch.float32))
    keep = (a > 0).float().mean().item()
    assert abs(keep - 0.75) < 0.02
    assert torch.equal(a.unique(), torch.tensor([0.0, 1 / 0.75]))
    bits = counter_bits(seed, 0, 1 << 16).to(torch.int64) & 0xFFFFFFFF  # 32-bit words, non-negative
    assert bits.min() >= 0 and bits.max() < 2 ** 32
    # roughly uniform: each of 16 buckets holds ~1/16 of the values
    counts = torch.bincount(bits >> 28, minlength=16).float() / bits.numel()
    assert (counts - 1 / 16).abs().max() < 0.01


def test_dropout_eval_and_errors():
    x = torch.randn(4, 4)
    assert dropout(x, 0.5, training=False) is x
    with pytest.raises(ValueError, match="needs a seed"):
        dropout(x, 0.5, training=True)
    with pytest.raises(ValueError, match="impl must be"):
        dropout(x, 0.5, training=True, impl="philox", seed=torch.tensor(1))


def test_same_seed_same_loss_different_seed_different_loss():
    torch.manual_seed(0)
    model = MHCGPT(MHCGPTConfig(**TINY, hidden_dropout=0.3)).train()
    ids = torch.randint(0, 32, (2, 8))
    out1 = model(ids, dropout_seed=torch.tensor(7))
    assert torch.equal(out1, model(ids, dropout_seed=torch.tensor(7)))
    assert not torch.equal(out1, model(ids, dropout_seed=torch.tensor(8)))


def test_tiny_model_learns_the_synthetic_corpus():
    cfg = RunConfig.from_dict({"model": dict(TINY, vocab_size=16, seq_length=12, hidden_size=32),
                               "train": {"steps": 40, "micro_batch_size": 16, "lr": 0.01}})
    result = train_config(cfg, progress=False)
    assert len(result.losses) == 40
    first = sum(result.losses[:3]) / 3
    last = sum(result.losses[-3:]) / 3
    assert last < 0.5 * first, (first, last)
