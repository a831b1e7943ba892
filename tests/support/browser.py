"""A real headless Chromium for the playground's tests: the system browser (Debian's ``chromium``) driven by
Playwright with ``executable_path`` (Playwright's own browser download is not reachable from these machines).

``chromium()`` skips the test with the reason where no Chromium is installed (``make test`` on a machine without
one; ``.ci/run`` installs it). ``PageWatch`` collects what the page must never do: an uncaught error, a
Content-Security-Policy violation, a console error, a dialog (``alert``). Screenshots go to
``$DIFFSTAGE_SCREENSHOTS`` when set (``make screenshots`` sets docs/img), else to the test's own folder.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# what Chromium logs for a resource the page asked for and the stage refused on purpose (a test of a 401, a 400)
EXPECTED_STATUSES = ("status of 400", "status of 401", "status of 404", "status of 409")


def chromium_path() -> str | None:
    return os.environ.get("DIFFSTAGE_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)


@contextlib.contextmanager
def chromium():
    """A launched headless Chromium (Playwright's Browser); skips the test where there is none."""
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; or set DIFFSTAGE_CHROMIUM): "
                    "the playground's browser tests drive a real one")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True,
                                             args=["--no-sandbox"] if os.geteuid() == 0 else [])
        try:
            yield browser
        finally:
            browser.close()


class PageWatch:
    """What a page did that a test forbids: uncaught errors, console errors (a CSP violation is one), dialogs."""

    def __init__(self, page, allowed: tuple[str, ...] = EXPECTED_STATUSES):
        self.page, self.allowed = page, allowed
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
        page.on("console", self._console)
        page.on("dialog", self._dialog)

    def _console(self, message) -> None:
        if message.type == "error" and not any(text in message.text for text in self.allowed):
            self.errors.append(f"console: {message.text}")

    def _dialog(self, dialog) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def assert_clean(self) -> None:
        assert not self.errors, self.errors
        assert not self.dialogs, self.dialogs


@contextlib.contextmanager
def open_page(browser, url: str, width: int = 1100, height: int = 720):
    """A fresh context (its own sessionStorage) with the page at ``url``; yields (page, watch); the watch must
    stay clean."""
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        page = context.new_page()
        watch = PageWatch(page)
        page.goto(url)
        yield page, watch
        watch.assert_clean()
    finally:
        context.close()


def screenshot_dir(fallback: Path) -> Path:
    folder = Path(os.environ.get("DIFFSTAGE_SCREENSHOTS") or fallback)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def image_of(page, selector: str) -> np.ndarray:
    """The image an ``<img>`` shows (its data: URL, as the page drew it from the stage's events), uint8 (H, W, 3)."""
    from stage_runtime.imageio import decode_image

    src = page.get_attribute(selector, "src")
    assert src and src.startswith("data:image/"), src
    return decode_image(base64.b64decode(src.split(",", 1)[1]), "image", 1 << 24)
