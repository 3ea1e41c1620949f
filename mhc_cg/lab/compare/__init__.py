"""Runs compared: every mode against eager without recompute (``mhc-cg train --compare``), and a
pipelined run against the same config on one rank."""
