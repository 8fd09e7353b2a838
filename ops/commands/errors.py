"""Errors of the commands and their exit codes."""
from __future__ import annotations

USAGE = 2    # bad arguments or input files: nothing was computed
FAILURE = 1  # the run itself failed


class UsageError(Exception):
    """A bad argument, or a missing or malformed input file (the message names it)."""
