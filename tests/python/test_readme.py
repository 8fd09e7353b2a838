"""Every Python example of the README runs as written (each block alone, in a fresh
namespace, in an empty folder), and the tracer's example prints the shapes it promises."""
from __future__ import annotations

import re
import sys
import types

import pytest

from conftest import REPO


def python_blocks(page: str = "README.md"):
    """(heading the block stands under, code) of each ```python block of ``page``."""
    text = (REPO / page).read_text()
    blocks, heading = [], "top"
    for match in re.finditer(r"^(#+ [^\n]*)$|^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("# ").strip()
        elif match.group(2) == "python":
            blocks.append(pytest.param(match.group(3), id=re.sub(r"\W+", "-", heading).strip("-")))
    return blocks


def test_readme_has_the_examples():
    ids = [block.id for block in python_blocks()]
    assert len(ids) >= 4, ids
    for words in ("Python-ops", "transformers", "TorchScript", "torch-compile"):
        assert any(words in name for name in ids), (words, ids)


@pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning",
                            "ignore:.*torch.jit.*:FutureWarning")
@pytest.mark.parametrize("code", python_blocks())
def test_readme_example_runs(code, tmp_path, monkeypatch, capsys):
    if "headscope.hf" in code:
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    # a module of its own, as a user's script would be: torch.compile looks its functions'
    # module up in sys.modules
    module = types.ModuleType("__readme__")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, "README.md", "exec"), module.__dict__)
    out = capsys.readouterr().out
    if "Tracer(" in code:
        assert "torch.Size([1, 36])" in out and "torch.Size([4, 8])" in out


@pytest.mark.parametrize("code", python_blocks("docs/explain.md"))
def test_explain_docs_example_runs(code, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/explain.md", "exec"), {})
    assert (tmp_path / "explained" / "index.html").is_file()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("0 'A red star at the top right.' [(2, "), printed


# each page's blocks run in order in one namespace, as a reader runs them one after another
DOC_PAGES = ("docs/effects.md", "docs/hf.md", "docs/mixer.md", "docs/shapes.md")


def test_every_docs_page_with_python_has_its_examples_run():
    pages = {str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")
             if "```python" in p.read_text()}
    assert pages == set(DOC_PAGES) | {"docs/explain.md"}, pages


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("page", DOC_PAGES)
def test_docs_examples_run_in_order(page, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    blocks = [block.values[0] for block in python_blocks(page)]
    assert blocks, page
    namespace = {}
    for code in blocks:
        exec(compile(code, page, "exec"), namespace)
    out = capsys.readouterr().out
    if page == "docs/effects.md":
        spans = len(namespace["spans"])
        assert spans > 0
        for shape in ((spans, 8), (spans, 16)):
            assert f"torch.Size([{shape[0]}, {shape[1]}])" in out, out
    if page == "docs/hf.md":  # the quantized model's example: its tiny model's L*H = 8
        assert "torch.Size([1, 36]) torch.Size([4, 16])" in out, out
        assert f"torch.Size([{len(namespace['spans'])}, 4])" in out, out


def test_readme_states_the_bad_input_count():
    import bad_inputs
    text = (REPO / "README.md").read_text()
    assert f"{len(bad_inputs.cases())} bad inputs" in text


def registered_ops():
    """(family, op) for every schema in csrc/registration.cpp, the family from the comment
    that opens its block."""
    family, ops = None, []
    for line in (REPO / "csrc" / "registration.cpp").read_text().splitlines():
        opened = re.match(r"\s*// -+ (\w+):", line)
        if opened:
            family = opened.group(1)
        for name in re.findall(r'm\.def\("(\w+)\(', line):
            ops.append((family, name))
    return ops


def test_every_op_is_in_the_readme_and_its_reference_page():
    ops = registered_ops()
    assert len(ops) >= 12, ops
    readme = (REPO / "README.md").read_text()
    for family, op in ops:
        assert re.search(rf"^\| [^\n]*`{op}\(", readme, re.M), f"{op} missing from the README's table"
        page = (REPO / "docs" / f"{family}.md").read_text()
        assert re.search(rf"^#+ .*`{op}`", page, re.M), f"{op} has no section in docs/{family}.md"
