"""``mhc-cg config check FILE``: validate a run config and print it fully resolved, as YAML.

The resolved config holds every field, defaults and derived values filled in (``ffn_hidden_size``,
``moe_ffn_hidden_size``), so what a run will use can be read and diffed; it loads back unchanged. A leading comment says what
the config implies (the training mode, L_r, the scopes handed to megatron-core). Problems go to
stderr, one line each, with exit status 2 (``mhc_cg.cli``).
"""

from __future__ import annotations

import argparse

import yaml

from mhc_cg.config import RunConfig, load_config
from mhc_cg.config.choices import RECOMPUTE_SCOPE
from mhc_cg.runtime.modes.registry import capture_plan

HELP = "validate a YAML run config and print it resolved (every field, defaults filled in)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_action", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="validate FILE and print the resolved config as YAML",
                           description="validate FILE and print the resolved config as YAML")
    check.add_argument("file", metavar="FILE", help="YAML run config")


class _Dumper(yaml.SafeDumper):
    """Block-style sections, flow-style lists: ``cuda_graph_scope: [attn, mhc_recompute]``."""


_Dumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def resolved_yaml(cfg: RunConfig) -> str:
    """``cfg`` as YAML, every field present, in the dataclasses' field order."""
    return yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def summary(cfg: RunConfig) -> str:
    """One comment line: what the config makes ``mhc-cg train`` do."""
    plan = capture_plan(cfg, on_this_machine=False)  # a config may be meant for another machine
    megatron = [s for s in cfg.graph.scopes if s != RECOMPUTE_SCOPE]
    return (f"# ok: mode {plan.mode}, L_r={cfg.model.resolved_recompute_layers}, "
            f"graphs {list(plan.scopes) or 'none'} on {plan.backend} "
            f"(megatron-core gets {megatron or 'none'})")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)  # raises ConfigError with every problem
    print(summary(cfg))
    print(resolved_yaml(cfg), end="")
    return 0
