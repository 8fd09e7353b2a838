"""Pictures of the explain page as a browser shows it: headless Chromium driven through
Selenium and chromium-driver (Debian: ``apt-get install chromium chromium-driver``;
``pip install selenium``). The tests use it to check the page; run as a script it writes
the screenshot the docs show, from the embedded shapes model:

    python -m headscope.explainer.screenshot docs/images/explain.png
    python -m headscope.explainer.screenshot docs/images/explain-ward.png --regions 8

(``--regions K``: K Ward regions instead of the world's 3 x 3 cells; ``--scores S``: a
scorer other than the shipped head, ``headscope.explain``'s ``scores=``.)
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

WINDOW = (1100, 900)


def browser_missing() -> str:
    """Why headless Chromium cannot be driven here, or "" when it can."""
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        return ("no chromium or chromedriver: apt-get install -y chromium chromium-driver "
                "(scripts/setup_env.sh does)")
    import importlib.util
    if importlib.util.find_spec("selenium") is None:
        return "no selenium: pip install selenium (requirements.txt pins it)"
    return ""


@contextmanager
def headless_chromium(width: int = WINDOW[0], height: int = WINDOW[1]):
    """A Selenium session of headless Chromium, quit on leaving."""
    from selenium import webdriver
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(argument)
    session = webdriver.Chrome(service=webdriver.ChromeService(shutil.which("chromedriver")),
                               options=options)
    session.set_page_load_timeout(30)
    try:
        yield session
    finally:
        session.quit()


def screenshot(page: Path, out: Path, span: int = 1) -> Path:
    """Opens ``page`` (an index.html), chooses its ``span``-th listed span and writes a
    PNG of the window to ``out``."""
    from selenium.webdriver.common.by import By

    from ..io import atomic_path
    with headless_chromium() as browser:
        browser.get(Path(page).resolve().as_uri())
        spans = browser.find_elements(By.CSS_SELECTOR, ".span")
        spans[min(span, len(spans) - 1)].click()
        with atomic_path(out) as tmp:
            Path(tmp).write_bytes(browser.get_screenshot_as_png())
    return Path(out)


def shapes_page(folder: Path, regions=(3, 3), scores=None) -> Path:
    """The explain page of the shapes model describing a held-out two-object scene, with
    the shipped head (or the scorer ``scores``) on ``regions``."""
    from ..shapes import load, prompt, scene
    from ..shapes.accuracy import HELD_OUT_SEED
    from ..shapes.demo import DEMO_OFFSET
    from . import explain
    model, processor, head = load(head=scores in (None, "head"))
    image, _ = scene(HELD_OUT_SEED + DEMO_OFFSET + 1, 2)
    return explain(model, processor, [image], "Describe the image.", head, scores=scores,
                   regions=regions, inputs=prompt(processor, image), max_new_tokens=24,
                   model_name="headscope.shapes (the embedded model)").save(folder)


def main(argv=None) -> int:
    import argparse

    from .scorers import SCORERS
    parser = argparse.ArgumentParser(prog="python -m headscope.explainer.screenshot",
                                     description="a screenshot of the shapes model's page")
    parser.add_argument("out", metavar="OUT.png")
    parser.add_argument("--regions", type=int, default=None, metavar="K",
                        help="K Ward regions (default: the world's 3 x 3 cells)")
    parser.add_argument("--scores", choices=tuple(SCORERS), default=None,
                        help="the scorer (default: the shipped head)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    missing = browser_missing()
    if missing:
        print(f"headscope.explainer.screenshot: {missing}", file=sys.stderr)
        return 2
    regions = (3, 3) if args.regions is None else args.regions
    with tempfile.TemporaryDirectory() as folder:
        print(screenshot(shapes_page(Path(folder), regions, args.scores), Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
