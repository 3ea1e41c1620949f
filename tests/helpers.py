"""Helpers shared by several test modules (``from helpers import ...``: pytest puts tests/ on the path)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from mhc_cg.config import RunConfig
from mhc_cg.model import MHCGPTConfig

REPO = Path(__file__).resolve().parents[1]


def tiny_run_config(*, scopes=("attn", "mlp", "mhc_recompute"), dtype: str = "fp32",
                    steps: int = 3, microbatches: int = 2, **train) -> RunConfig:
    """A tiny mHC GPT that trains in seconds on one CPU thread, dropout on, block recompute."""
    cfg = RunConfig()
    cfg.model = MHCGPTConfig(vocab_size=32, seq_length=8, hidden_size=16, num_heads=2,
                             num_layers=4, num_streams=4, hidden_dropout=0.2,
                             recompute="block", recompute_layers=2)
    cfg.train = dataclasses.replace(cfg.train, steps=steps, micro_batch_size=2,
                                    num_microbatches=microbatches, dtype=dtype, device="cpu",
                                    **train)
    cfg.graph = dataclasses.replace(cfg.graph, backend="auto", cuda_graph_scope=list(scopes))
    return cfg


def write_config(tmp_path: Path, text: str | bytes, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m mhc_cg.cli ARGV`` in a fresh process (exit status, stdout, stderr)."""
    return subprocess.run([sys.executable, "-m", "mhc_cg.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
