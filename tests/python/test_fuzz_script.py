"""scripts/fuzz.sh's repeatable mode does the same work on every machine: two runs (the second
on one core, as a slower machine) execute the same inputs, counted and digested by the
harnesses themselves. Needs the sanitized build's fuzz harnesses (scripts/test.sh builds
them before pytest; locally: bash scripts/sanitized_build.sh headscope_fuzz_vas ...)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / os.environ.get("HEADSCOPE_SANITIZE_BUILD_DIR", "build-sanitize")
FAMILIES = ("vas", "attribution", "mixer")
GENERATED = 12  # per family: enough to show the count, cheap (the harnesses start in ~2 s)

pytestmark = pytest.mark.skipif(
    not all((BUILD / f"headscope_fuzz_{f}").exists() for f in FAMILIES),
    reason=f"the fuzz harnesses are not built in {BUILD} (bash scripts/sanitized_build.sh "
           "headscope_fuzz_vas headscope_fuzz_attribution headscope_fuzz_mixer; CI builds them)")

TALLY = re.compile(r"== fuzz (\w+): (\d+) saved and (\d+) generated inputs.*\n"
                   r"headscope fuzz tally: (\d+) inputs, digest ([0-9a-f]{16})")


def repeatable_run(one_core: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HEADSCOPE_FUZZ_SECONDS"}
    env["HEADSCOPE_FUZZ_INPUTS"] = str(GENERATED)
    command = ["bash", "scripts/fuzz.sh"]
    if one_core and shutil.which("taskset"):
        command = ["taskset", "-c", str(min(os.sched_getaffinity(0))), *command]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {m[1]: (int(m[2]), int(m[3]), int(m[4]), m[5]) for m in TALLY.finditer(done.stdout)}


@pytest.mark.timeout(600)
def test_repeatable_fuzzing_runs_the_same_inputs_every_time():
    first, second = repeatable_run(one_core=False), repeatable_run(one_core=True)
    assert set(first) == set(FAMILIES)
    assert first == second
    for family, (saved, generated, ran, _) in first.items():
        assert saved == len(list((REPO / "fuzz" / "corpus" / family).iterdir())) >= 1
        assert generated == GENERATED
        assert ran == saved + generated + 1  # and libFuzzer's empty input
