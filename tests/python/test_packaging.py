"""What ``pip install .`` puts in the package: every module of ops/ (setup.py finds the
subpackages by their ``__init__.py``), so a test that imports a subpackage from an installed
copy cannot meet a missing module."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup_packages():
    from setuptools import find_packages
    source = (ROOT / "setup.py").read_text()
    assert 'find_packages("ops")' in source, "setup.py must find the packages under ops/"
    return {"headscope"} | {"headscope." + p for p in find_packages(str(ROOT / "ops"))}


def test_every_folder_of_python_modules_is_an_installed_package():
    packages = _setup_packages()
    for folder in sorted({p.parent for p in (ROOT / "ops").rglob("*.py")}):
        name = ".".join(["headscope", *folder.relative_to(ROOT / "ops").parts])
        assert (folder / "__init__.py").exists(), f"{folder} holds modules but no __init__.py"
        assert name in packages, f"{name} would be left out of pip install ."


def test_every_headscope_import_in_the_tests_names_an_installed_package():
    packages = _setup_packages()
    for test in sorted((ROOT / "tests" / "python").glob("*.py")):
        for node in ast.walk(ast.parse(test.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if not re.match(r"headscope(\.|$)", name):
                    continue
                parts = name.split(".")
                # the longest prefix that is a package; the rest is a module inside it
                held = any(".".join(parts[:i]) in packages for i in range(len(parts), 0, -1))
                module = ROOT / "ops" / Path(*parts[1:])
                assert held and (len(parts) == 1 or module.with_suffix(".py").exists()
                                 or (module / "__init__.py").exists()), \
                    f"{test.name} imports {name}, which pip install . would not hold"
