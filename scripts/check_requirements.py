"""Exits 0 when every line of a requirements file is satisfied by what is installed."""
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

ok = True
for line in Path(sys.argv[1]).read_text().splitlines():
    line = line.split("#")[0].strip()
    if not line:
        continue
    req = Requirement(line)
    try:
        have = version(req.name)
    except PackageNotFoundError:
        print(f"setup: {req.name} is not installed")
        ok = False
        continue
    if req.specifier and not req.specifier.contains(have.split("+")[0], prereleases=True):
        print(f"setup: {req.name} {have} does not satisfy {req}")
        ok = False
sys.exit(0 if ok else 1)
