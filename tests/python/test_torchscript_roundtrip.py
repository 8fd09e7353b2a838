"""TorchScript round trip: a module calling headscope ops is scripted and saved here,
then loaded and run by a fresh Python process and by the C++ example program
(examples/torchscript_cpp, built against the installed CMake package)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import headscope


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("roundtrip")
    torch.manual_seed(0)
    module = headscope.FactorMixer(num_heads=2, head_dim=8, rank=3)
    args = [torch.randn(2, 2, 24, 8) for _ in range(3)]
    eager = module(*args)
    torch.jit.script(module).save(str(tmp / "module.pt"))
    torch.save(args, tmp / "inputs.pt")
    return tmp, eager


def test_fresh_python_process_runs_the_saved_module(saved):
    tmp, eager = saved
    code = ("import sys, torch, headscope\n"
            "m = torch.jit.load(sys.argv[1])\n"
            "torch.save(m(*torch.load(sys.argv[2], weights_only=True)), sys.argv[3])\n")
    subprocess.run([sys.executable, "-c", code, str(tmp / "module.pt"), str(tmp / "inputs.pt"),
                    str(tmp / "py_out.pt")], check=True)
    assert torch.equal(torch.load(tmp / "py_out.pt", weights_only=True), eager)


def test_cpp_example_runs_the_saved_module(saved):
    binary = os.environ.get("HEADSCOPE_EXAMPLE_BIN", "")
    if not Path(binary).is_file():
        pytest.skip("C++ example not built: scripts/test.sh builds it and sets "
                    "HEADSCOPE_EXAMPLE_BIN (scripts/build_example.sh builds it alone)")
    tmp, eager = saved
    result = subprocess.run([binary, str(tmp / "module.pt"), str(tmp / "inputs.pt"),
                             str(tmp / "cpp_out.pt")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert torch.equal(torch.load(tmp / "cpp_out.pt", weights_only=True), eager)
