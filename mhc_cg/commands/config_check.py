"""``mhc-cg config check FILE``: validate a run config and print it fully resolved, as YAML.

The resolved config holds every field, defaults and derived values filled in (``ffn_hidden_size``,
``moe_ffn_hidden_size``), so what a run will use can be read and diffed; it loads back unchanged. A leading comment says what
the config implies (the training mode, L_r, the scopes handed to megatron-core). Problems go to
stderr, one line each, with exit status 2 (``mhc_cg.cli``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from mhc_cg.config import RunConfig

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
    from mhc_cg.config.choices import ARITHMETIC_NAMES, RECOMPUTE_SCOPE
    from mhc_cg.lab.resolve import resolve

    plan = resolve(cfg, on_this_machine=False).plan  # a config may be meant for another machine
    megatron = [s for s in cfg.graph.scopes if s != RECOMPUTE_SCOPE]
    mhc = ("" if cfg.model.residual == "plain"
           else f"arithmetic {cfg.model.arithmetic} ({ARITHMETIC_NAMES[cfg.model.arithmetic]}), ")
    line = (f"# ok: mode {plan.mode}, {mhc}L_r={cfg.model.resolved_recompute_layers}, "
            f"graphs {list(plan.scopes) or 'none'} on {plan.api} "
            f"(megatron-core gets {megatron or 'none'})")
    return line if plan.api != "te" else f"{line}\n{te_line()}"


def te_line() -> str:
    """Which TransformerEngine's ``make_graphed_callables`` ``graph.backend: te`` runs here."""
    from mhc_cg.lab.emulation.backends import te_python
    from mhc_cg.lab.emulation.te_wheel import GRAPH, find_te_wheel, te_missing_reason, te_wheel

    where = te_python()
    if where == "installed":
        from importlib.metadata import version

        return (f"# te: the installed TransformerEngine {version('transformer_engine')}'s "
                f"make_graphed_callables, over torch.cuda graphs")
    if where == "wheel":
        wheel = te_wheel(str(find_te_wheel()))
        wheel.graph_module()  # its files checked by their hashes: a changed one is refused here
        return (f"# te: TransformerEngine {wheel.version}'s make_graphed_callables from its wheel's "
                f"source ({wheel.wheel}/{GRAPH}, every file it runs checked by its sha256), over "
                f"{'torch.cuda graphs' if _cuda() else 'the tape (this machine has no GPU)'}")
    return f"# te: not at hand on this machine: {te_missing_reason()}"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args: argparse.Namespace) -> int:
    from mhc_cg.config import load_config

    cfg = load_config(args.file)  # raises ConfigError with every problem
    print(summary(cfg))
    print(resolved_yaml(cfg), end="")
    return 0
