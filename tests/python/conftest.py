"""Shared pytest fixtures: the devices every device test runs on, and the folder of the
reference implementations (../shared/seeds; docs/vas.md, docs/mixer.md)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import headscope  # noqa: F401  (loads the ops)

REPO = Path(__file__).resolve().parents[2]
SEEDS = REPO.parent / "shared" / "seeds"

# Every device test is parametrised over these; CUDA skips with a visible reason.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="CUDA: no GPU on this machine")),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def load_seed(module_name: str):
    """Imports ../shared/seeds/<module_name>.py, or skips when the folder is absent."""
    path = SEEDS / f"{module_name}.py"
    if not path.is_file():
        pytest.skip(f"reference implementation not available ({path} is absent in this clone)")
    spec = importlib.util.spec_from_file_location(f"seed_{module_name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
