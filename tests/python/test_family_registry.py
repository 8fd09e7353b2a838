"""The family registry (headscope.hf.families) and what derives from it: docs/hf.md's
families table and the README's list of families are the ones scripts/readme_families.py
writes from the registry (every registered model type has its row), every family has its
tests' side (headscope.hf.testing.families), and every model type has a geometry test
against its real processor or a waiver with a reason in its testing module; the tiny
models' lists and tokens come from the registry, and a family module or testing module
that leaves anything out, or gives two roles one token id, is refused when it
registers."""
from __future__ import annotations

import importlib.util
import re
from typing import Dict, List

import pytest

from conftest import REPO
from headscope.hf.families import FAMILIES, Family, register, supported_model_types
from headscope.hf.families.base import REGISTRY
from headscope.hf.testing import TinyFamily, TinySpec, tiny_of
from headscope.hf.testing.families import check_every_family_tested
from headscope.hf.testing.spec import TINY, register_tiny
from headscope.hf.testing.tokens import EOS, IMAGE_TOKEN, MARKER_IDS

TESTS = REPO / "tests" / "python"


def docs_rows() -> Dict[str, str]:
    """Each model type of docs/hf.md's families table (its "model types" column, each in
    backticks) with its row."""
    text = (REPO / "docs" / "hf.md").read_text()
    table = text[text.index("| family | model types |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        for model_type in re.findall(r"`([a-z0-9_]+)`", line.split("|")[2]):
            rows[model_type] = line
    return rows


def geometry_tests(model_type: str) -> List[str]:
    """The test files that check ``model_type``'s layout against its real processor: a
    tests/python/test_families_*.py that builds a tiny processor and names the model type."""
    return [p.name for p in sorted(TESTS.glob("test_families_*.py"))
            if "tiny_processor(" in p.read_text() and f'"{model_type}"' in p.read_text()]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_model_type_is_documented_and_geometry_tested_or_waived(family):
    rows = docs_rows()
    for model_type in family.model_types:
        assert model_type in rows, f"{model_type}: no row in docs/hf.md's families table"
    untested = [t for t in family.model_types if not geometry_tests(t)]
    waiver = tiny_of(family).spec.geometry_waiver
    if waiver is None:
        assert not untested, (f"{untested}: no tests/python/test_families_*.py checks the "
                              f"layout against the real processor, and {family.name}'s "
                              f"TinySpec gives no geometry_waiver")
    else:
        assert len(waiver) > 40  # a reason, not a flag


def test_readme_list_is_the_registry():
    spec = importlib.util.spec_from_file_location("readme_families",
                                                  REPO / "scripts" / "readme_families.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = (REPO / "README.md").read_text()
    listed = " ".join(script.families_list().split())  # a title may wrap across lines
    assert all(title in listed for family in FAMILIES for title in family.titles)
    assert readme == script.rewritten(readme), (
        "README.md's list of families is not the registry's: run python "
        "scripts/readme_families.py")


def test_hf_docs_table_is_the_registry():
    spec = importlib.util.spec_from_file_location("readme_families",
                                                  REPO / "scripts" / "readme_families.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = (REPO / "docs" / "hf.md").read_text()
    for family in FAMILIES:
        assert all(f"`{t}`" in script.families_table() for t in family.model_types)
    assert page == script.rewritten_hf_docs(page), (
        "docs/hf.md's families table is not the registry's: run python "
        "scripts/readme_families.py")


def test_docs_table_lists_no_unregistered_model_type():
    assert set(docs_rows()) == set(supported_model_types())


def test_tiny_lists_and_tokens_come_from_the_registry():
    from headscope.hf import testing
    from headscope.hf.testing import special_tokens
    assert testing.FAMILIES == supported_model_types()
    assert len(set(supported_model_types())) == len(supported_model_types())
    assert sorted(REGISTRY, key=lambda f: f.name) == list(FAMILIES)
    for family in FAMILIES:
        for model_type in family.model_types:
            assert special_tokens(model_type) == {i: n for n, i in
                                                  tiny_of(family).spec.tokens.items()}
    with pytest.raises(ValueError, match="family must be one of .*got 'gpt2'"):
        special_tokens("gpt2")
    with pytest.raises(ValueError, match="family must be one of .*got 'gpt2'"):
        testing.tiny_model("gpt2")


def test_every_family_has_its_tests_side():
    assert all(type(family) in TINY for family in FAMILIES)
    toy = type("Toy", (Family,), dict(name="toy", titles=("Toy",), model_types=("toy",),
                                     layout="none"))()
    with pytest.raises(TypeError, match=r"no module registers the tests' side .*\['Toy'\]"):
        check_every_family_tested([*FAMILIES, toy])


def _family(**overrides):
    attributes = dict(name="toy", titles=("Toy",), model_types=("toy",), layout="none")
    attributes.update(overrides)
    return type("Toy", (Family,), attributes)


def _tiny(spec):
    return type("TinyToy", (TinyFamily,), {} if spec is None else {"spec": spec})


@pytest.mark.parametrize("overrides, error", [
    (dict(model_types=("qwen2_vl",)), r"model types \['qwen2_vl'\] are already registered"),
])
def test_registration_refuses_an_incomplete_or_colliding_family(overrides, error):
    cls = _family(**overrides)
    before = list(REGISTRY)
    with pytest.raises((TypeError, ValueError), match=error):
        register(cls)
    assert REGISTRY == before


@pytest.mark.parametrize("spec, error", [
    (None, "must set its own tiny"),
    (TinySpec(tokens={"<image>": IMAGE_TOKEN, "</s>": EOS, "<a>": MARKER_IDS[0],
                      "<b>": MARKER_IDS[0]}, chat_template=""),
     r"the tiny tokens \['<a>', '<b>'\] share the ids \[505\]"),
    (TinySpec(tokens={"<image>": IMAGE_TOKEN}, chat_template=""), "need IMAGE_TOKEN and EOS"),
    (TinySpec(tokens={"<image>": IMAGE_TOKEN, "</s>": EOS, "<big>": 600}, chat_template=""),
     r"out of range: \['<big>'\]"),
    (TinySpec(tokens={"<image>": IMAGE_TOKEN, "</s>": EOS}, chat_template="",
              commands=("qwen2_vl",)), "names model types of no family of its own"),
])
def test_testing_registration_refuses_an_incomplete_or_colliding_spec(spec, error):
    before = dict(TINY)
    with pytest.raises((TypeError, ValueError), match=error):
        register_tiny(_family())(_tiny(spec))
    assert TINY == before


def test_a_subclass_must_declare_its_own_tiny_spec():
    from headscope.hf.families.qwen_vl import QwenVL
    from headscope.hf.testing.families.qwen_vl import TinyQwenVL
    family = type("Child", (QwenVL,), dict(name="child", titles=("Child",),
                                          model_types=("child",), layout="Qwen's"))
    child = type("TinyChild", (TinyQwenVL,), {})
    with pytest.raises(TypeError, match="must set its own tiny"):
        register_tiny(family)(child)


def test_registration_refuses_a_family_that_leaves_its_names_to_its_parent():
    from headscope.hf.families.qwen_vl import QwenVL
    child = type("Child", (QwenVL,), dict(name="child", titles=("Child",),
                                         model_types=("child",)))
    before = list(REGISTRY)
    with pytest.raises(TypeError, match="must set its own layout"):
        register(child)
    assert REGISTRY == before
