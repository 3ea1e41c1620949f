"""DeepSeek-V4.1's delayed pre (``model.arithmetic: v41``): the model against the fp64 equations,
eager block recompute bit for bit, and the config naming the variant or refusing a mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mhc_cg.config import MHCGPTConfig, RunConfig, load_config
from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.references import delayed_pre_fp64 as ref
from mhc_cg.lab.resolve import resolve
from mhc_cg.model import MHCGPT

ROOT = Path(__file__).resolve().parents[1]


def _model(arithmetic: str = "v41", dtype=torch.float32) -> MHCGPT:
    """A small v41 GPT with mixes far from their init, so that comb is not near uniform."""
    torch.manual_seed(0)
    model = MHCGPT(MHCGPTConfig(arithmetic=arithmetic, hidden_dropout=0.0, num_layers=2,
                                hidden_size=32, seq_length=16))
    with torch.no_grad():
        for sub in model.sublayers():
            sub.hc.bias.normal_(0, 1.0)
            sub.hc.alpha_pre.fill_(0.7)
            sub.hc.alpha_post.fill_(0.5)
            sub.hc.alpha_res.fill_(0.9)
            sub.hc.mapping_proj.weight.normal_(0, 0.3)
            sub.norm.weight.uniform_(0.5, 1.5)
    return model.to(dtype)


def _grads(model, logits, targets) -> dict[str, torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten()).backward()
    return {name: p.grad.double() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_v41_model_matches_the_fp64_equations_values_and_every_gradient(dtype, tol):
    model = _model(dtype=dtype)
    oracle = ref.fp64_copy(model)
    ids, targets = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    got, want = model(ids), ref.forward(oracle, ids)
    assert (got.double() - want).abs().max() <= tol * want.abs().max()
    g_got, g_want = _grads(model, got, targets), _grads(oracle, want, targets)
    scale = max(g.abs().max() for g in g_want.values())
    assert set(g_got) == set(g_want) and len(g_got) > 20
    for name, g in g_want.items():
        assert (g_got[name] - g).abs().max() <= tol * scale, name
    # the comb of the second site is far from uniform (mixing identical streams would hide it)
    sub = oracle.sublayers()[1]
    x = torch.randn(48, 4 * 32, dtype=torch.float64)
    scale3 = torch.cat([sub.hc.alpha_pre, sub.hc.alpha_post, sub.hc.alpha_res])
    comb = ref.coefficients(x, sub.hc.mapping_proj.weight, scale3, sub.hc.bias, 4, 20)[2]
    assert comb.max() > 0.6 and comb.min() < 0.1


def test_the_delayed_pre_is_not_deepseek_v4s_arithmetic():
    ids = torch.randint(0, 64, (2, 16))
    v41, v4 = _model("v41"), _model("dev")
    v4.load_state_dict(v41.state_dict())
    assert (v41(ids) - v4(ids)).abs().max() > 1e-3


def test_v41_compare_eager_block_bit_identical_and_graphed_modes_refused_one_line_each():
    out = subprocess.run([sys.executable, "-m", "mhc_cg", "train", "--config",
                          str(ROOT / "configs" / "tiny_cpu_v41.yaml"), "--compare", "--steps", "3",
                          "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "DeepSeek-V4.1's mHC" in out.stdout
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("eager_")}
    assert "bit-identical" in rows["eager_block"]
    refused = [line for line in out.stdout.splitlines() if ": not run: " in line]
    assert {line.split(":")[0] for line in refused} >= {"graphed_static", "graphed_full_static"}
    assert all("model.arithmetic: v41" in line for line in refused)


def test_config_names_the_arithmetic_and_refuses_what_cannot_run_it():
    out = subprocess.run([sys.executable, "-m", "mhc_cg", "config", "check",
                          str(ROOT / "configs" / "tiny_cpu_v41.yaml")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "arithmetic v41 (DeepSeek-V4.1's mHC, the delayed pre)" in out.stdout.splitlines()[0]
    cfg = load_config(str(ROOT / "configs" / "tiny_cpu_v41.yaml"))
    with pytest.raises(ConfigError, match=r"^model\.arithmetic: v41 .*mode graphed_static"):
        resolve(cfg.replace(graph={"cuda_graph_scope": ["attn", "mhc_recompute"]}),
                on_this_machine=False)
    with pytest.raises(ConfigError, match=r"model\.arithmetic: must be one of"):
        RunConfig.from_dict({"model": {"arithmetic": "v4"}})
