"""The suite's own bounds hold: a test that hangs or takes too much memory stops the run
with every thread's stack (instead of taking the machine or CI's time), and an isolated
test runs in a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _run_pytest(tmp_path, body: str, *args, env=None):
    test = tmp_path / "test_probe.py"
    test.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "conftest", "-c", str(REPO / "pytest.ini"),
                           "--rootdir", str(tmp_path), str(test), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=str(HERE), **(env or {})))


def test_a_hanging_test_stops_the_run_with_every_threads_stack(tmp_path):
    run = _run_pytest(tmp_path, """
        import threading
        def test_waits_for_what_never_comes():
            threading.Event().wait()
        """, "--timeout", "3")
    assert run.returncode != 0
    assert "Timeout" in run.stderr + run.stdout
    assert "test_waits_for_what_never_comes" in run.stderr + run.stdout


def test_a_test_over_the_memory_limit_is_stopped_and_named(tmp_path):
    run = _run_pytest(tmp_path, """
        import torch
        def test_eats_memory():
            kept = [torch.ones(2 ** 27) for _ in range(8)]  # 4 GiB
        """, env={"HEADSCOPE_TEST_MAX_RSS_GIB": "1"})
    assert run.returncode == 3
    assert "over its limit of 1 GiB, in test_probe.py::test_eats_memory" in run.stderr
    assert "Current thread" in run.stderr  # every thread's traceback


@pytest.mark.isolated(max_rss_gib=2)
def test_an_isolated_test_runs_in_a_process_of_its_own():
    assert os.environ.get("HEADSCOPE_ISOLATED_TEST") == "1"
    assert os.environ.get("HEADSCOPE_TEST_MAX_RSS_GIB") == "2"
