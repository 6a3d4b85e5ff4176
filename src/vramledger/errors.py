"""The one user-facing error type, and the exit codes. Only ``cli.main`` catches it and prints ``error: …``.

Exit codes, the same for every command (docs/cli.md):

====  ==========================================================================================================
0     the answer is yes: the setup fits (estimate, trace, measure), a plan or a fit was found, the check is clean
1     an unexpected failure: a bug in vramledger, or a GPU trial that crashed or timed out (please report bugs)
2     bad input: an argument, a file or an environment that cannot be used; one ``error:`` line says what to fix
3     the answer is no: the setup does not fit, nothing fits (fit, plan, find-max), the script check has findings
====  ==========================================================================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_INPUT = 2
EXIT_NO = 3
"""Does not fit / nothing fits / findings: a valid question whose answer is no."""


class VramledgerError(Exception):
    """A problem with the user's input or environment, explained in one line with its fix.

    ``exit_code`` is ``EXIT_BAD_INPUT`` (2, the default), ``EXIT_NO`` (3) when the request is valid and its
    answer is "does not fit", or ``EXIT_UNEXPECTED`` (1) for failures of an otherwise valid request.
    """

    def __init__(self, message: str, *, exit_code: int = EXIT_BAD_INPUT) -> None:
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
            + (
                " (and torch; its CPU build: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)"
                if extra == "trace"
                else ""
            ),
            exit_code=EXIT_BAD_INPUT,
        )
