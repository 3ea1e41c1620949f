"""The activation memory model: its formulas per token (the planner, the memory report and the
arena agree on them) and what a forward really saves, measured (``mhc-cg memory``)."""
