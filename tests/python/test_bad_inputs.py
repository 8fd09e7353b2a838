"""Runs the bad-input matrix (bad_inputs.py) in a fresh process, so that a crash fails this
test instead of the whole run, and reports every failing case."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import bad_inputs


def test_every_op_handles_every_bad_input():
    script = Path(__file__).with_name("bad_inputs.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, cwd=script.parent)
    lines = run.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert run.returncode == 0 and not failed, (
        f"exit {run.returncode}; {len(failed)} failing cases:\n" + "\n".join(failed[:30])
        + f"\nlast output: {lines[-3:]}\nstderr: {run.stderr[-2000:]}")
    total = len(bad_inputs.cases())
    assert lines[-1] == f"{total} cases, 0 failed"
    assert total >= 400  # the README states the count
