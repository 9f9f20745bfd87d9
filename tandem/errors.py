"""The console script's one error type."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing failure of a `tandem` command: printed as one line, exit status 2."""
