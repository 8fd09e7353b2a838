"""Errors of the commands and their exit codes, and the checks of arguments that the
commands (and ``python -m headscope.shapes``) share. A bad argument is reported before
any work, in one line that names it, says what was given and what is allowed, with exit
code 2 and nothing created."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable, Optional

USAGE = 2          # bad arguments or input files: nothing was computed
FAILURE = 1        # the run itself failed
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), after one line saying so


class UsageError(Exception):
    """A bad argument, or a missing or malformed input file (the message names it)."""


def reported(prog: str, work: Callable[[], int]) -> int:
    """``work()``'s exit code; a UsageError or Ctrl-C in it is one line on stderr, naming
    ``prog``, and exit 2 or 130."""
    try:
        return work()
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED


class _Store(argparse._StoreAction):
    """argparse's plain option that also records, in ``given_options``, that it was given
    (so that an option given where it has no effect can be refused)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.__dict__.setdefault("given_options", set()).add(self.dest)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: ...``, exit 2, no usage
    block) and that records which options were given (:func:`given`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _Store)
        self.register("action", "store", _Store)

    def error(self, message):
        self.exit(USAGE, f"{self.prog}: error: {message} (see --help)\n")


def given(args) -> set:
    """The options (destinations) given on the command line, not left at their default."""
    return set(getattr(args, "given_options", ()))


def integer(low: int, high: Optional[int] = None, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (``high`` None: no upper bound);
    ``why`` says where the upper bound comes from."""
    allowed = f"an integer >= {low}" if high is None else \
        f"an integer from {low} to {high}{why}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value
    return parse


def number(low: float, *, above: bool = False, below: Optional[float] = None
           ) -> Callable[[str], float]:
    """An argparse type: a finite number ``>= low`` (``> low`` when ``above``), and
    ``< below`` when given."""
    allowed = f"a finite number {'>' if above else '>='} {low:g}" + \
        ("" if below is None else f" and < {below:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if above else value >= low)
                and (below is None or value < below)):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value
    return parse


def grid(max_rows: Optional[int] = None, max_cols: Optional[int] = None, why: str = ""
         ) -> Callable[[str], str]:
    """An argparse type: ``ROWSxCOLS``, each >= 1 (and at most ``max_rows`` /
    ``max_cols`` when given), spelt ``f"{rows}x{cols}"``."""
    def parse(text: str) -> str:
        from ..hf.regions import parse_grid
        try:
            rows, cols = parse_grid(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if max_rows is not None and (rows > max_rows or cols > max_cols):
            raise argparse.ArgumentTypeError(f"must be at most {max_rows}x{max_cols}{why}, "
                                             f"got {text!r}")
        return f"{rows}x{cols}"
    return parse


def refuse_ignored(args, names, reason: str) -> None:
    """UsageError when one of the options ``names`` was given although ``reason`` makes it
    have no effect."""
    ignored = sorted(given(args) & set(names))
    if ignored:
        raise UsageError(f"{option(ignored[0])} {getattr(args, ignored[0])}: has no effect "
                         f"{reason}; leave it out")


def option(dest: str) -> str:
    """The command-line spelling of an argparse destination."""
    return "--" + dest.replace("_", "-")


def check_output(path, name: str, *, folder: bool = False) -> None:
    """UsageError, before any work, unless ``path`` can be written: a file (``folder``
    False) needs an existing writable folder and must not be a folder itself; a folder is
    created with its parents if needed, so its nearest existing ancestor must be a
    writable folder."""
    path = Path(path)
    where = f"{name} {path}"
    if folder:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{where}: exists and is not a folder; allowed: a folder, or a "
                             f"path to create one at")
        parent = path
        while not parent.exists():
            parent = parent.parent
    else:
        if path.is_dir():
            raise UsageError(f"{where}: is a folder; allowed: a file's path")
        parent = path.parent
        if not parent.exists():
            raise UsageError(f"{where}: its folder {parent} does not exist; allowed: a file "
                             f"in an existing folder")
    if not parent.is_dir():
        raise UsageError(f"{where}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: the folder {parent} is not writable")
