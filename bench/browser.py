"""A headless Chromium for the plan report: the test (tests/test_report.py) and
the timings (bench/report.py) open the page the way a user does, from file://.

Debian's ``chromium`` package driven by Playwright's Python API (``playwright`` from
PyPI, launched with ``executable_path``: no browser is downloaded). Where either is
missing, ``why_no_browser()`` says so, and the test is skipped with that reason.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Optional

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> Optional[str]:
    """$SHARDPROP_CHROMIUM, else the first Chromium on PATH."""
    given = os.environ.get("SHARDPROP_CHROMIUM")
    if given:
        return given if os.path.exists(given) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def why_no_browser() -> Optional[str]:
    """None if a report can be opened here, else the reason it cannot."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if find_chromium() is None:
        return ("no Chromium found (apt-get install chromium, or set SHARDPROP_CHROMIUM to its path); "
                f"looked for {', '.join(CANDIDATES)} on PATH")
    return None


@contextlib.contextmanager
def chromium():
    """A headless Chromium browser (Playwright's ``Browser``)."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=find_chromium(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--allow-file-access-from-files"])
        try:
            yield browser
        finally:
            browser.close()


class Opened:
    """A report open in a page, with the console errors it printed and how long it took."""

    def __init__(self, page, errors: list, wall_s: float):
        self.page, self.errors, self.wall_s = page, errors, wall_s

    @property
    def ready_ms(self) -> float:
        """Milliseconds from the start of navigation to the page drawn and answering clicks
        (the page's own clock)."""
        return self.page.evaluate("window.shardpropReport.readyMs")


def open_report(browser, path, width: int = 1280, height: int = 800, timeout_s: float = 30) -> Opened:
    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    t0 = time.perf_counter()
    page.goto(Path(path).resolve().as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=timeout_s * 1000)
    return Opened(page, errors, time.perf_counter() - t0)
