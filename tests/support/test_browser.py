"""Where no Chromium is installed the browser tests skip, saying what to install (make test on a bare machine)."""

from __future__ import annotations

import pytest

from support.browser import chromium, chromium_path


def test_without_a_chromium_the_browser_tests_skip_saying_what_to_install(monkeypatch, tmp_path):
    monkeypatch.delenv("DIFFSTAGE_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))                       # an empty PATH: no browser on it
    assert chromium_path() is None
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        with chromium():
            pass


def test_a_chromium_named_in_the_environment_is_the_one_used(monkeypatch):
    monkeypatch.setenv("DIFFSTAGE_CHROMIUM", "/opt/chromium/chrome")
    assert chromium_path() == "/opt/chromium/chrome"
