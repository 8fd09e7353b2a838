"""The benchmarks stay runnable: each family's ``--quick`` run completes in a fresh process
and reports every section it prints (timings are for reading, never asserted)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("family", ["mixer", "vas", "attribution", "hf"])
def test_quick_benchmark_runs(family, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "headscope.bench", "--family", family, "--quick",
                             "--device", "cpu", "--json", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    sections = json.loads(out.read_text())["families"][family]
    assert sections, "no section reported"
    empty = [name for name, rows in sections.items() if not rows]
    assert not empty, f"sections without results: {empty}"
