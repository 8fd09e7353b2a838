"""Loads the compiled op library so that ``torch.ops.headscope.*`` exists."""
from __future__ import annotations

import os
from pathlib import Path

import torch

_LIB_NAME = "libheadscope.so"


def library_path() -> Path:
    """Where the compiled library is: $HEADSCOPE_LIBRARY, else the one installed with the package."""
    override = os.environ.get("HEADSCOPE_LIBRARY")
    path = Path(override) if override else Path(__file__).with_name("lib") / _LIB_NAME
    if not path.is_file():
        raise ImportError(
            f"headscope: compiled library not found at {path}; build it with "
            "`pip install --no-build-isolation .` (or set HEADSCOPE_LIBRARY to a CMake build's "
            f"{_LIB_NAME})")
    return path


def load() -> Path:
    path = library_path()
    torch.ops.load_library(str(path))
    return path
