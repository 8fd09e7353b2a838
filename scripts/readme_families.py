"""Rewrites what the docs say of the family registry: the README's list of supported VLMs
(between its ``families:begin`` and ``families:end`` markers), from the registry and the
generic path's tested models, and docs/hf.md's families table (between its
``families-table:begin`` and ``families-table:end`` markers), a row per family module:
``python scripts/readme_families.py``. tests/python/test_family_registry.py fails while
either differs from what this writes."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
HF_DOCS = ROOT / "docs" / "hf.md"
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"
TABLE_BEGIN, TABLE_END = "<!-- families-table:begin -->", "<!-- families-table:end -->"


def layout_only(family) -> bool:
    """Whether only the family's picture layout is supported (tracing it is expected to
    fail: its testing module's TinySpec.contract_xfail)."""
    from headscope.hf.testing import tiny_of
    return tiny_of(family).spec.contract_xfail is not None


def families_list() -> str:
    """The README's list: the families with a module (the picture plane), then the models
    the generic path is tested on."""
    from headscope.hf.families import FAMILIES
    from headscope.hf.testing.newest import RECIPES
    traced = [t for f in FAMILIES if not layout_only(f) for t in f.titles]
    layout_only_titles = [t for f in FAMILIES if layout_only(f) for t in f.titles]
    lines = [f"Families with the picture plane (one module each in "
             f"`headscope/hf/families/`): {', '.join(traced)}."]
    if layout_only_titles:
        lines.append(f"Picture layout only (tracing not yet supported): "
                     f"{', '.join(layout_only_titles)}.")
    lines.append(f"Read by their structure (the generic path), tested on: "
                 f"{', '.join(title for title, _ in RECIPES.values())}.")
    # names stay whole on one line ("LLaVA-NeXT": the registry test looks each one up)
    return "\n\n".join(textwrap.fill(line, 90, break_on_hyphens=False, break_long_words=False)
                       for line in lines)


def families_table() -> str:
    """docs/hf.md's table: each family module's titles, model types and layout line."""
    from headscope.hf.families import FAMILIES

    def cell(text: str) -> str:
        # tokens such as <img> or <|image|> as code (not HTML), their pipes escaped so that
        # they stay in their cell
        return re.sub(r"(<[^\s<>]+>)", r"`\1`", text).replace("|", "\\|")

    rows = ["| family | model types | layout |", "| --- | --- | --- |"]
    for family in FAMILIES:
        name = ", ".join(family.titles) + (" (layout only)" if layout_only(family) else "")
        types = ", ".join(f"`{t}`" for t in family.model_types)
        rows.append(f"| {cell(name)} | {types} | {cell(family.layout)} |")
    return "\n".join(rows)


def between(text: str, begin: str, end: str, body: str, where: str) -> str:
    """``text`` with what stands between its markers ``begin`` and ``end`` replaced."""
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"{where} must hold {begin} and {end} once each")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def rewritten(readme: str) -> str:
    return between(readme, BEGIN, END, families_list(), "README.md")


def rewritten_hf_docs(page: str) -> str:
    return between(page, TABLE_BEGIN, TABLE_END, families_table(), "docs/hf.md")


if __name__ == "__main__":
    README.write_text(rewritten(README.read_text()))
    HF_DOCS.write_text(rewritten_hf_docs(HF_DOCS.read_text()))
