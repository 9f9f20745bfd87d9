"""The console script's one error type."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing failure of a `tandem` command: printed as one line; `status` is the exit
    status (2: bad input or a refused request, the default; 1: a runtime failure, such as a
    gateway that cannot be reached)."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status
