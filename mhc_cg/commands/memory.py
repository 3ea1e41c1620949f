"""``mhc-cg memory``: bytes saved for backward per layer, measured, beside the analytical model."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from mhc_cg.core.errors import ConfigError

HELP = "measure activation bytes saved for backward per layer (recompute none vs block)"

_OVERRIDES = {"hidden": "hidden_size", "seq": "seq_length", "layers": "num_layers",
              "streams": "num_streams", "recompute_layers": "recompute_layers",
              "heads": "num_heads", "ffn": "ffn_hidden_size"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mhc_cg.core.dtypes import TORCH_DTYPES

    parser.add_argument("--config", default=None, help="YAML run config (default: embedded tiny model)")
    parser.add_argument("--hidden", type=int, help="override model.hidden_size")
    parser.add_argument("--heads", type=int, help="override model.num_heads")
    parser.add_argument("--ffn", type=int, help="override model.ffn_hidden_size (default with "
                        "--hidden: 4 * hidden)")
    parser.add_argument("--seq", type=int, help="override model.seq_length")
    parser.add_argument("--layers", type=int, help="override model.num_layers")
    parser.add_argument("--streams", type=int, help="override model.num_streams (n)")
    parser.add_argument("--recompute-layers", type=int, help="override model.recompute_layers (L_r)")
    parser.add_argument("--mbs", type=int, help="micro-batch size (default: train.micro_batch_size)")
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp32", help="activation dtype")
    parser.add_argument("--device", choices=("meta", "cpu", "cuda"), default="meta",
                        help="meta: no allocation, any size (attention takes the math path); "
                             "cpu/cuda: real tensors (fused attention kernels where available)")
    parser.add_argument("--json", action="store_true", help="print the measurement as JSON")


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:10.2f} MiB"


def format_table(r: dict, cfg) -> str:
    lines = [f"mHC GPT: hidden {cfg.hidden_size}, seq {cfg.seq_length}, mbs {r['micro_batch_size']}, "
             f"{cfg.num_layers} layers, n={cfg.num_streams}, {r['dtype']}, device {r['device']}, "
             f"L_r={r['recompute_layers']} (blocks {r['blocks']})",
             f"{'per layer':34}{'recompute=none':>16}{'recompute=block':>16}{'none - block':>16}",
             f"{'measured saved for backward':34}{_mib(r['none']['per_layer_bytes']):>16}"
             f"{_mib(r['block']['per_layer_bytes']):>16}{_mib(r['difference']['measured']):>16}",
             f"{'mHC state, saved-tensor model':34}{_mib(r['model']['none']):>16}"
             f"{_mib(r['model']['block']):>16}{_mib(r['difference']['model']):>16}",
             f"{'mHC state, intermediates model':34}{_mib(r['model']['design_none']):>16}"
             f"{_mib(r['model']['block']):>16}{_mib(r['difference']['design_model']):>16}",
             *_activation_lines(r),
             f"block / none (measured): {r['block_over_none']:.3f}",
             f"(none - block) measured vs saved-tensor model: "
             f"{100 * r['difference']['relative_error']:+.1f}%; vs intermediates model: "
             f"{100 * r['difference']['design_relative_error']:+.1f}%",
             f"block managers hold {r['block']['manager_bytes']} B (RNG states) in "
             f"{r['block']['num_blocks']} blocks; outside the layers: embedding "
             f"{r['none']['embedding_saved_bytes']} B, head {r['none']['head_saved_bytes']} B"]
    return "\n".join(lines)


def _activation_lines(r: dict) -> list[str]:
    """Rows for ``recompute_activation``, when the model has a dense MLP."""
    act = r.get("activation")
    if act is None:
        return []
    saved = act["saved_per_layer"]
    return [f"{'measured, + recompute_activation':34}{_mib(act['none']['per_layer_bytes']):>16}"
            f"{_mib(act['block']['per_layer_bytes']):>16}"
            f"{_mib(act['none']['per_layer_bytes'] - act['block']['per_layer_bytes']):>16}",
            f"{'  saved by recompute_activation':34}{_mib(saved['none']):>16}"
            f"{_mib(saved['block']):>16}",
            f"{'  gelu output, model (ffn per token)':34}{_mib(r['model']['activation']):>16}"
            f"{_mib(r['model']['activation']):>16}"]


def run(args: argparse.Namespace) -> int:
    from mhc_cg.config import load_config
    from mhc_cg.lab.memory.measure import measure_saved_bytes

    cfg = load_config(args.config)
    overrides = {field: getattr(args, flag) for flag, field in _OVERRIDES.items()
                 if getattr(args, flag) is not None}
    if args.hidden is not None and args.ffn is None:  # the config resolved ffn from its own hidden
        overrides["ffn_hidden_size"] = 4 * args.hidden
        overrides["moe_ffn_hidden_size"] = None
    model_cfg = replace(cfg.model, **overrides)  # re-runs the config checks
    mbs = cfg.train.micro_batch_size if args.mbs is None else args.mbs
    if mbs < 1:
        raise ConfigError(f"--mbs: must be a positive integer, got {mbs}")
    result = measure_saved_bytes(model_cfg, mbs, device=args.device, dtype=args.dtype)
    print(json.dumps(result, indent=2) if args.json else format_table(result, model_cfg))
    return 0
