"""Errors users see: one clear line per problem, naming the field and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """One or more problems in a configuration; ``problems`` holds one line each."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
