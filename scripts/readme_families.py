"""Rewrites the README's list of supported VLMs (between its ``families:begin`` and
``families:end`` markers) from the family registry and the generic path's tested models:
``python scripts/readme_families.py``. tests/python/test_family_registry.py fails while the
README's list differs from what this writes."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"


def families_list() -> str:
    """The README's list: the families with a module (the picture plane), then the models
    the generic path is tested on."""
    from headscope.hf.families import FAMILIES
    from headscope.hf.testing import tiny_of
    from headscope.hf.testing.newest import RECIPES
    traced = [t for f in FAMILIES if tiny_of(f).spec.contract_xfail is None for t in f.titles]
    layout_only = [t for f in FAMILIES if tiny_of(f).spec.contract_xfail is not None
                   for t in f.titles]
    lines = [f"Families with the picture plane (one module each in "
             f"`headscope/hf/families/`): {', '.join(traced)}."]
    if layout_only:
        lines.append(f"Picture layout only (tracing not yet supported): "
                     f"{', '.join(layout_only)}.")
    lines.append(f"Read by their structure (the generic path), tested on: "
                 f"{', '.join(title for title, _ in RECIPES.values())}.")
    # names stay whole on one line ("LLaVA-NeXT": the registry test looks each one up)
    return "\n\n".join(textwrap.fill(line, 90, break_on_hyphens=False, break_long_words=False)
                       for line in lines)


def rewritten(readme: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise ValueError(f"README.md must hold {BEGIN} and {END} once each")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{families_list()}\n{END}{tail}"


if __name__ == "__main__":
    sys.exit(README.write_text(rewritten(README.read_text())) and 0)
