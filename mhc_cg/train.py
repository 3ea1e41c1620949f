"""The training loop behind ``mhc-cg train``."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import RunConfig
from .data import ProgressionCorpus
from .errors import ConfigError
from .model import MHCGPT
from .nvtx_ranges import nvtx_range


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)

    @property
    def median_step_ms(self) -> float:
        times = sorted(self.step_times[1:] or self.step_times)  # the first step pays warm-up
        return 1000.0 * times[len(times) // 2]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' was asked for but this torch build sees no CUDA GPU; "
                          "use 'cpu' or 'auto'")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"train.device: must be one of ['cpu', 'cuda', 'auto'], got {name!r}")
    return torch.device(name)


class ProgressBar:
    """A one-line progress bar on stderr (silent when ``enabled`` is false)."""

    def __init__(self, total: int, label: str, enabled: bool = True, width: int = 30):
        self.total, self.label, self.enabled, self.width = total, label, enabled, width

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * done // max(self.total, 1)
        line = f"{self.label} [{'#' * filled}{'-' * (self.width - filled)}] {done}/{self.total} {note}"
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{line}" + ("\n" if done >= self.total else ""))
        elif done == 1 or done >= self.total or done % max(self.total // 10, 1) == 0:
            sys.stderr.write(line + "\n")  # logs get a line every 10%, not a carriage-return smear
        sys.stderr.flush()


def train(cfg: RunConfig, *, steps: int | None = None, device: str | None = None,
          progress: bool = True, model: MHCGPT | None = None) -> TrainResult:
    """Train ``cfg.model`` on the synthetic corpus; returns per-step losses and timings."""
    dev = resolve_device(device or cfg.train.device)
    steps = cfg.train.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"--steps: must be a positive integer, got {steps}")
    torch.manual_seed(cfg.train.seed)
    model = (model or MHCGPT(cfg.model)).to(dev).train()
    corpus = ProgressionCorpus(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr,
                                  weight_decay=cfg.train.weight_decay)
    result = TrainResult()
    bar = ProgressBar(steps, "train", progress)
    for step in range(steps):
        start = time.perf_counter()
        with nvtx_range("step"):  # profiler ranges; one name per phase so runs aggregate by name
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for _ in range(cfg.train.num_microbatches):
                inputs, targets = (t.to(dev) for t in corpus.batch(cfg.train.micro_batch_size))
                with nvtx_range("forward"):
                    logits = model(inputs)
                    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / cfg.train.num_microbatches
                with nvtx_range("backward"):
                    loss.backward()
                loss_sum += loss.item()
            with nvtx_range("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                optimizer.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        result.step_times.append(time.perf_counter() - start)
        result.losses.append(loss_sum)
        result.grad_norms.append(float(grad_norm))
        bar.update(step + 1, f"loss {loss_sum:.4f}")
    return result
