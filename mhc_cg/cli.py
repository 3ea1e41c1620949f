"""``mhc-cg``: one entry point, one module per subcommand under ``mhc_cg/commands/``.

Each command module defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``, and
imports at its top only what loads without torch: whatever pulls torch in (the config, the
registry of modes, the tools), ``add_arguments`` and ``run`` import when they are called. The
parser adds a command's arguments only when that command is parsed, so ``mhc-cg --help`` reads
each command's ``HELP`` and imports no torch.

Errors a user can fix (``ConfigError``, ``ValueError`` from bad input) end the process with
exit status 2 and one line per problem on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from mhc_cg.core.errors import ConfigError

DESCRIPTION = ("mHC activation recompute inside CUDA graphs: train an mHC GPT with static-buffer "
               "recompute under graph capture (bit for bit like eager without recompute), cost "
               "its memory and time without a GPU, run its kernels beside their peers, and run "
               "Megatron-LM's own mHC under its own graph helpers.")
EPILOG = "mhc-cg COMMAND --help says more; start with: mhc-cg train --compare"

# command name -> module under mhc_cg.commands
COMMANDS = {"train": "train", "memory": "memory", "schedule": "schedule", "config": "config_check",
            "timeline": "timeline", "bench": "bench", "cost": "cost", "kernels": "kernels",
            "megatron": "megatron"}


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its command module's ``add_arguments`` runs the first time it
    parses or prints its usage, so building the whole parser costs only the ``HELP`` lines."""

    command: ModuleType | None = None

    def _add_command_arguments(self) -> None:
        command, self.command = self.command, None
        if command is not None:
            command.add_arguments(self)
            self.set_defaults(_run=command.run)

    def parse_known_args(self, args=None, namespace=None):
        self._add_command_arguments()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_command_arguments()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_command_arguments()
        return super().format_help()


def _command_modules():
    for name, module in COMMANDS.items():
        yield name, importlib.import_module(f"mhc_cg.commands.{module}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhc-cg", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=CommandParser)
    for name, module in _command_modules():
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        cmd.command = module
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"mhc-cg {args.command}: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
