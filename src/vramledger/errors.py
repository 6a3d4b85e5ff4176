"""The one user-facing error type. Only ``cli.main`` catches it and prints ``error: …``."""

from __future__ import annotations


class VramledgerError(Exception):
    """A problem with the user's input or environment, explained in one line with its fix.

    ``exit_code`` is 2 for bad input (the default) and 1 for failures of an otherwise valid request.
    """

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


class MissingDependencyError(VramledgerError):
    """An optional heavy dependency (torch, transformers, matplotlib) is not installed."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"this command needs {package}; install it with: pip install 'vramledger[{extra}]'"
            + (" (and torch: pip install torch==2.13.0 for the CPU build)" if extra == "trace" else ""),
            exit_code=2,
        )
