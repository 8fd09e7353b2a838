"""Pictures of the explain page as a browser shows it: headless Chromium driven through
Selenium and chromium-driver (Debian: ``apt-get install chromium chromium-driver``;
``pip install selenium``). The tests use it to check the page, and ``python -m
headscope.shapes screenshot`` to write the picture the docs show."""
from __future__ import annotations

import shutil
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
