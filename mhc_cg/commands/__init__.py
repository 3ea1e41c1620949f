"""Subcommands of ``mhc-cg``; see ``mhc_cg/cli.py``."""
