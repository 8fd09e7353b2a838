"""Writes the fixed inputs that scripts/fuzz.sh's repeatable mode replays for one family:
COUNT files of 8 to 96 random bytes (the harnesses read a few dozen), drawn from a
generator seeded by the family's name, so that every machine and every run gets the same
bytes. Prints their SHA-256 (over the files in order).

    python scripts/fuzz_inputs.py FAMILY COUNT OUT_DIR
"""
from __future__ import annotations

import hashlib
import random
import shutil
import sys
from pathlib import Path


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    family, count, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if count < 0:
        sys.exit(f"fuzz_inputs.py: COUNT must be >= 0, got {count}")
    # a str seed is hashed with SHA-512 (random.seed's version 2): the same on every machine,
    # whatever PYTHONHASHSEED
    rng = random.Random(f"headscope fuzz {family}")
    # written beside OUT_DIR and renamed, so that an interrupted run leaves no partial set
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    digest = hashlib.sha256()
    for i in range(count):
        data = rng.randbytes(rng.randint(8, 96))
        (partial / f"{i:07d}").write_bytes(data)
        digest.update(data)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    print(digest.hexdigest())


if __name__ == "__main__":
    main()
