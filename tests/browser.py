"""Headless Chromium for the tests that look at pages as a person does (the HTML metrics report,
the Ray dashboard). Needs /usr/bin/chromium (tests/install-system.sh installs it);
ORCHESTRATOR_SKIP_BROWSER_TESTS=1 skips those tests instead."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
# Where screenshots are kept for a person to look at after the run (CI keeps the folder).
ARTIFACTS = Path(
    os.environ.get("ORCHESTRATOR_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts")
)


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    if os.environ.get("ORCHESTRATOR_SKIP_BROWSER_TESTS") == "1":
        pytest.skip("ORCHESTRATOR_SKIP_BROWSER_TESTS=1: pages are not checked in a browser")
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: run tests/install-system.sh (or set "
            "ORCHESTRATOR_SKIP_BROWSER_TESTS=1 to skip the browser tests)"
        )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
