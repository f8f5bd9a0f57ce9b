"""The dashboard web page in a real browser (Debian's headless Chromium driven by Playwright),
against the whole running stack: log in with a token, watch a job's loss curve grow, follow it to
its end, see the worker. Leaves screenshots under test-artifacts/ (TRAINYARD_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from service.embedded import embedded_stack
from tests.conftest import IN_CI, REPO
from tests.e2e.test_end_to_end import wait_for_event
from tests.e2e.test_faults import signal_ranks, training_ranks
from tests.helpers import tiny_spec
from workers.launch import EVENTS_FILE_NAME, attempt_dir
from workers.supervisor import EventTail, free_port

pytestmark = pytest.mark.timeout(300)

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("TRAINYARD_TEST_ARTIFACTS", REPO / "test-artifacts"))


@pytest.fixture
def browser_page():
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
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        yield page
        browser.close()


def points_drawn(page, series: str) -> int:
    """How many points the job page's chart has drawn for a series."""
    polyline = page.locator(f'polyline[data-series="{series}"]')
    if polyline.count() == 0:
        return 0
    return len(polyline.get_attribute("points").split())


def test_the_dashboard_logs_in_and_shows_a_running_job_curve_growing_to_the_end(browser_page, tmp_path, monkeypatch):
    page = browser_page
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # The worker delivers metrics every heartbeat (5 s in production); this job takes seconds, so
    # deliveries come every half second, for the curve to grow while the page is open.
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
    with embedded_stack(tmp_path / "yard", free_port(), workers=1) as info:
        client = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30)
        spec = tiny_spec(**{
            "name": "watched-run", "training.max_steps": 1500, "training.eval_every": 250, "checkpoint.every_steps": 500,
        })
        job_id = client.post("/v1/jobs", json=spec).json()["id"]
        # The training is paused (SIGSTOP) from its first step until the job page shows the curve:
        # a fast machine trains the 1,500 steps in seconds, and the curve must grow in view.
        run_dir = attempt_dir(info.data_dir / "work", job_id, 1)
        wait_for_event(EventTail(run_dir / EVENTS_FILE_NAME), "metrics")
        ranks = training_ranks(run_dir)
        signal_ranks(ranks, signal.SIGSTOP)
        try:
            # A wrong token is refused and the login form comes back saying so. (Waiting for the form
            # alone raced: it is still there while the refusal is on its way.)
            page.goto(f"{info.url}/dashboard")
            page.fill("#token", "not-a-token")
            page.click("button[type=submit]")
            page.locator("form.login p.error", has_text="refused").wait_for()

            page.fill("#token", info.token)
            page.click("button[type=submit]")
            row = page.locator("tr", has=page.locator("a", has_text="watched-run"))
            row.wait_for()

            row.locator("a", has_text="watched-run").click()
            page.wait_for_url(f"**/dashboard#/jobs/{job_id}")
            page.wait_for_function("() => document.querySelector('polyline[data-series=\"train_loss\"]')", timeout=120_000)
            first = points_drawn(page, "train_loss")
        finally:
            signal_ranks(ranks, signal.SIGCONT)

        # The job page: the loss curve gains points while we watch (the page polls the API).
        page.wait_for_function(
            f"() => document.querySelector('polyline[data-series=\"train_loss\"]').getAttribute('points').split(' ').length > {first}",
            timeout=60_000,
        )
        assert points_drawn(page, "train_loss") > first >= 1
        page.screenshot(path=str(ARTIFACTS / "dashboard-job-running.png"), full_page=True)

        # Followed to the end: final status, every step on the curve, eval points, checkpoints listed.
        page.wait_for_selector("h2 .status.succeeded", timeout=180_000)
        page.wait_for_function(
            "() => document.querySelector('polyline[data-series=\"train_loss\"]').getAttribute('points').split(' ').length === 1500",
            timeout=30_000,
        )
        assert points_drawn(page, "eval_loss") == 6 and points_drawn(page, "lr") == 1500
        assert page.locator("table tr", has=page.locator("button", has_text="download")).count() == 2  # keep_last 2
        assert "train_loss" in page.inner_text(".charts")
        page.screenshot(path=str(ARTIFACTS / "dashboard-job-done.png"), full_page=True)

        # The checkpoint download button hands the browser the safetensors file the API serves.
        with page.expect_download() as download:
            page.locator("button", has_text="download").last.click()
        latest = max(client.get(f"/v1/jobs/{job_id}/checkpoints").json(), key=lambda c: c["step"])
        served = client.get(f"/v1/checkpoints/{latest['id']}/download").content
        assert Path(download.value.path()).read_bytes() == served

        # The workers page shows the embedded worker host, online and idle again.
        page.click("a[href='#/workers']")
        worker_row = page.locator("tr", has_text="local-0")
        worker_row.wait_for()
        slots = client.get("/v1/workers").json()[0]["slots"]
        page.wait_for_function(f"() => document.body.innerText.includes('0 / {slots}')", timeout=30_000)
        assert "yes" in worker_row.inner_text()
        page.screenshot(path=str(ARTIFACTS / "dashboard-workers.png"), full_page=True)
        client.close()
