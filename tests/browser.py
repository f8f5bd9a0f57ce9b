"""The dashboard page in a real browser: Debian's headless Chromium driven by Playwright (never
`playwright install`'s download). Tests that use it leave screenshots under ARTIFACTS: look at them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import IN_CI, REPO

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("TRAINYARD_TEST_ARTIFACTS", REPO / "test-artifacts"))


@pytest.fixture
def browser():
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        missing = f"playwright is not installed: {exc}"
    if missing is None and not shutil.which(CHROMIUM):
        missing = f"{CHROMIUM} is missing (apt-get install chromium)"
    if missing:
        if IN_CI:
            pytest.fail(f"CI=true: {missing}", pytrace=False)
        pytest.skip(missing)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()
