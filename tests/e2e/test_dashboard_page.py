"""The dashboard web page in a real browser (Debian's headless Chromium driven by Playwright),
against the whole running stack: log in with a token, watch a job's curves grow from its event
stream, follow it to its end, a script's own metrics, two runs compared, the worker, dark mode
at a phone's width. Leaves screenshots under test-artifacts/ (TRAINYARD_TEST_ARTIFACTS): look at them."""

from __future__ import annotations

import io
import json
import re
import signal
import tarfile
from pathlib import Path

import httpx
import pytest

from stack.embedded import embedded_stack
from tests.browser import ARTIFACTS
from tests.e2e.test_end_to_end import wait_for, wait_for_event
from tests.e2e.test_faults import signal_ranks, training_ranks
from tests.helpers import tiny_spec
from trainyard.client import Client
from workers.launch import EVENTS_FILE_NAME, attempt_dir
from workers.outbox import EventTail
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(600)



# A script job that reports metrics of its own names through accelerator.log.
OWN_METRICS_SCRIPT = b"""
import math, time
from accelerate import Accelerator

accelerator = Accelerator()
for step in range(1, 31):
    loss = 3.0 / step
    accelerator.log({"loss": loss, "perplexity": math.exp(loss)}, step=step)
    time.sleep(0.05)
import os
os.makedirs("out", exist_ok=True)
open("out/result.txt", "w").write("a script's output")
"""


def points_drawn(page, chart: str, line: str) -> int:
    """How many points a chart of the page has drawn for one of its lines (0 if it has no such chart or line)."""
    box = page.locator(f'[data-chart="{chart}"]')
    if box.count() == 0:
        return 0
    return json.loads(box.get_attribute("data-points") or "{}").get(line, 0)


def drawn(chart: str, line: str) -> str:
    """The same, as an expression for page.wait_for_function."""
    return f"(JSON.parse(document.querySelector('[data-chart=\"{chart}\"]')?.dataset.points || '{{}}')[{json.dumps(line)}] || 0)"


def legend(page, chart: str) -> dict[str, str]:
    """A chart's legend as shown: {line: value}."""
    rows = page.locator(f'.chart[data-chart="{chart}"] .u-legend tr.u-series')
    return {rows.nth(i).locator(".u-label").inner_text(): rows.nth(i).locator(".u-value").inner_text() for i in range(rows.count())}


def assert_the_loss_chart_reads_well(page, client: httpx.Client, job_id: int) -> None:
    """What an ML engineer missed on the job page: the loss chart full width, its legend read without
    hovering, evaluations never smoothed nor shown as the current step's, sizes and ticks as people read them."""
    loss = page.locator('.chart[data-chart="train_loss"]')
    assert loss.bounding_box()["width"] >= 0.9 * page.locator('section[data-group="Loss"] .charts').bounding_box()["width"]
    series = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss,eval_loss"}).json()["series"]
    shown = lambda value: page.evaluate(f"short({value})")  # noqa: E731 (the page's own number format)
    last_eval, last_train = series["eval_loss"]["values"][-1], series["train_loss"]["values"][-1]
    assert legend(page, "train_loss") == {"step": "600", "train_loss": shown(last_train), "eval_loss": shown(last_eval)}  # not hovered: the last step's

    # Smoothed, the training curve moves and the evaluations don't: each is an exact value.
    page.locator("input[aria-label=smoothing]").fill("0.8")
    page.wait_for_function(f"() => document.querySelector('.chart[data-chart=\"train_loss\"] .u-legend tr.u-series .u-value').textContent !== {json.dumps(shown(last_train))}")
    assert legend(page, "train_loss")["eval_loss"] == shown(last_eval)
    page.locator("input[aria-label=smoothing]").fill("0")

    # Between two evaluations (every 100 steps) the legend gives the one before, saying from which step.
    box = loss.locator(".u-over").bounding_box()
    page.mouse.move(box["x"] + 0.27 * box["width"], box["y"] + box["height"] / 2)
    hovered = legend(page, "train_loss")
    eval_step = int(hovered["eval_loss"].rpartition(" @ ")[2])
    assert eval_step % 100 == 0 and " @ " not in hovered["train_loss"], hovered
    page.mouse.move(0, 0)

    rows = page.locator("table tr", has=page.locator("button", has_text="download")).all()
    sizes = [row.locator("td").nth(2).inner_text() for row in rows]
    assert sizes and all(size.endswith((" KiB", " MiB")) and not size.startswith("0.0") for size in sizes), sizes
    losses = [row.locator("td").nth(1).inner_text() for row in rows]  # a checkpoint at an evaluation's step shows its eval_loss
    assert all(loss == "–" or float(loss) > 0 for loss in losses), losses
    assert page.evaluate("ticks(null, [0, 0.0002, 0.0004], 1, 0, 0.0002)") == ["0", "2e-4", "4e-4"]  # an lr axis's zero is 0, not 0e+0
    # A job keeping its best by another metric (a custom loop's g_loss, a script's accuracy): that metric beside
    # eval_loss and "(best)" on it, also where the step has no eval_loss.
    rows = page.evaluate("""[...checkpointsTable([
        {step: 10, eval_loss: null, best: true, best_value: 0.81234, size_bytes: 1, sha256: "a".repeat(64), created_at: null},
        {step: 20, eval_loss: 1.5, best: false, best_value: null, size_bytes: 1, sha256: "b".repeat(64), created_at: null},
      ], {keep_best: true, best_metric: "accuracy", best_mode: "max"}).querySelectorAll("tr")].map(r => [...r.cells].slice(0, 3).map(c => c.textContent))""")
    assert rows == [["step", "eval_loss", "accuracy"], ["10", "–", "0.8123 (best)"], ["20", "1.5000", "–"]]


def overview_clone_and_cancel(page, client: httpx.Client, job_id: int) -> None:
    """A job's overview: its run time, last values and spec; cloned with a change, refused naming the
    field, submitted, and the new job cancelled from its page."""
    page.click(f"a[href='#/jobs/{job_id}']")
    page.locator("details.spec summary").click()
    # The page redraws its overview as the job's events come (the spec unfolded stays so): its table
    # is read once drawn with the spec's fields (a full run once read it empty).
    spec_table = page.locator("details.spec table", has_text="optimizer.lr")
    spec_table.wait_for(timeout=15_000)
    assert "0.003" in spec_table.inner_text()
    facts = page.inner_text(".overview .toolbar")
    assert "run time" in facts and "eval_loss" in facts and "train_loss" in facts, facts

    page.click("#clone-job")
    edited = json.loads(page.locator("#resubmit-spec").input_value())
    assert edited["name"] == "higher-lr-again" and edited["optimizer"]["lr"] == 0.003
    edited["training"]["max_steps"] = -1
    page.locator("#resubmit-spec").fill(json.dumps(edited))
    page.click("form.resubmit button[type=submit]")
    page.locator("#resubmit-error", has_text="training.max_steps").wait_for()
    edited["training"].update(max_steps=10**6, eval_every=10**5)
    page.locator("#resubmit-spec").fill(json.dumps(edited))
    page.click("form.resubmit button[type=submit]")
    page.wait_for_function(f"() => /^#\\/jobs\\/\\d+$/.test(location.hash) && location.hash !== '#/jobs/{job_id}'")
    clone_id = int(page.evaluate("location.hash").rpartition("/")[2])
    clone = client.get(f"/v1/jobs/{clone_id}").json()
    assert clone["name"] == "higher-lr-again" and clone["spec"]["training"]["max_steps"] == 10**6 and clone["spec"]["optimizer"]["lr"] == 0.003

    page.click("#cancel-job")
    page.wait_for_selector("h2 .status.cancelled", timeout=60_000)
    assert wait_for(client, clone_id, {"cancelled"})["status"] == "cancelled"
    page.screenshot(path=str(ARTIFACTS / "dashboard-job-cancelled.png"), full_page=True)


def upload_script(client: httpx.Client, source: bytes) -> int:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        entry = tarfile.TarInfo("train.py")
        entry.size = len(source)
        tar.addfile(entry, io.BytesIO(source))
    response = client.post("/v1/code", params={"name": "train.tgz"}, content=out.getvalue(), headers={"Content-Type": "application/octet-stream"})
    return response.json()["id"]


def test_the_dashboard_streams_every_series_compares_runs_and_fits_a_phone(browser, tmp_path, monkeypatch):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    # The worker delivers metrics (and samples the machine) every heartbeat (5 s in production);
    # this job takes seconds, so every half second, for the curve to grow while the page is open.
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
    with embedded_stack(tmp_path / "yard", free_port(), workers=1, devices="cpu:2") as info:
        client = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30)
        spec = tiny_spec(**{
            "name": "watched-run", "training.max_steps": 600, "training.eval_every": 100, "checkpoint.every_steps": 200,
        })
        job_id = client.post("/v1/jobs", json=spec).json()["id"]
        script = {"name": "own-metrics", "script": {"entrypoint": "train.py", "code": {"upload_id": upload_script(client, OWN_METRICS_SCRIPT)}, "outputs": ["out"]}}
        script_id = client.post("/v1/jobs", json=script).json()["id"]
        other = tiny_spec(**{"name": "higher-lr", "training.max_steps": 60, "training.eval_every": 30, "optimizer.lr": 0.003})
        other_id = client.post("/v1/jobs", json=other).json()["id"]  # runs once the script job has freed its slot
        # The training is paused (SIGSTOP) from its first step until the job page shows the curve:
        # a fast machine trains the 600 steps in seconds, and the curve must grow in view.
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
            page.wait_for_function(f"() => {drawn('train_loss', 'train_loss')} >= 1", timeout=120_000)
            first = points_drawn(page, "train_loss", "train_loss")
            # The worker's samples of the attempt's processes, though its training is stopped.
            page.wait_for_function(f"() => {drawn('sys/cpu_percent', 'sys/cpu_percent')} >= 2", timeout=60_000)
            assert points_drawn(page, "sys/memory_mb", "sys/memory_mb") >= 2
            assert page.locator('section[data-group="System"] [data-chart]').count() >= 2
        finally:
            signal_ranks(ranks, signal.SIGCONT)

        # The curves grow from the event stream: the series were read once, and never again.
        page.wait_for_function(f"() => {drawn('train_loss', 'train_loss')} > {first}", timeout=60_000)
        page.screenshot(path=str(ARTIFACTS / "dashboard-job-running.png"), full_page=True)
        assert sum("/metrics?" in url for url in requests) == 1
        assert sum(f"/v1/jobs/{job_id}/events" in url for url in requests) >= 1

        # Followed to the end: final status and no speed, every step on the curves, eval points, checkpoints listed.
        page.wait_for_selector("h2 .status.succeeded", timeout=300_000)
        page.wait_for_function(f"() => {drawn('train_loss', 'train_loss')} === 600", timeout=30_000)
        assert points_drawn(page, "train_loss", "eval_loss") == 6 and points_drawn(page, "lr", "lr") == 600
        assert points_drawn(page, "tokens_per_s", "tokens_per_s") == 600 and points_drawn(page, "grad_norm", "grad_norm") == 600
        assert "step/s" not in page.inner_text(".summary") and "ended" in page.inner_text(".summary")
        assert page.locator("table tr", has=page.locator("button", has_text="download")).count() == 2  # keep_last 2
        assert sum("/metrics?" in url for url in requests) == 1
        assert_the_loss_chart_reads_well(page, client, job_id)
        page.screenshot(path=str(ARTIFACTS / "dashboard-job-done.png"), full_page=True)

        # The checkpoint download button hands the browser the safetensors file the API serves.
        with page.expect_download() as download:
            page.locator("button", has_text="download").last.click()
        latest = max(client.get(f"/v1/jobs/{job_id}/checkpoints").json(), key=lambda c: c["step"])
        served = client.get(f"/v1/checkpoints/{latest['id']}/download").content
        assert Path(download.value.path()).read_bytes() == served

        # A script job's own metrics get their charts; a finished job's page loads its points at once.
        wait_for(client, script_id, {"succeeded"})
        page.goto(f"{info.url}/dashboard#/jobs/{script_id}")
        page.wait_for_function(f"() => {drawn('perplexity', 'perplexity')} === 30", timeout=30_000)
        assert points_drawn(page, "loss", "loss") == 30
        assert page.locator('section[data-group="Reported by the job"] [data-chart="perplexity"]').count() == 1
        # Its overview lists what it wrote (script.outputs), downloadable as a tar.
        outputs = page.locator(".overview .outputs table")
        outputs.wait_for()
        with page.expect_download() as fetched:
            outputs.locator("button", has_text="download").click()
        assert tarfile.open(fetched.value.path()).extractfile(f"job{script_id}-output/out/result.txt").read() == b"a script's output"
        page.screenshot(path=str(ARTIFACTS / "dashboard-script-job.png"), full_page=True)

        # Compare: tick two jobs in the table; each chart overlays both, and the spec diff shows what differs.
        wait_for(client, other_id, {"succeeded"})
        page.goto(f"{info.url}/dashboard#/jobs")
        page.get_by_label(f"select job {job_id}").check()
        page.get_by_label(f"select job {other_id}").check()
        page.click("#compare")
        page.wait_for_url(f"**/dashboard#/compare/{job_id},{other_id}")
        label = {job_id: f"#{job_id} watched-run", other_id: f"#{other_id} higher-lr"}
        page.wait_for_function(f"() => {drawn('lr', label[other_id] + ' · lr')} === 60", timeout=30_000)
        for chart in ["train_loss", "lr", "eval_loss", "sys/cpu_percent"]:
            points = json.loads(page.locator(f'[data-chart="{chart}"]').get_attribute("data-points"))
            assert len(points) == 2 and all(count > 0 for count in points.values()), (chart, points)
        diff = page.inner_text(".spec-diff")
        assert "optimizer.lr" in diff and "0.003" in diff and "training.max_steps" in diff
        assert "model.n_embd" not in diff  # the same in both: not shown
        assert page.locator(".u-legend", has_text="higher-lr").count() >= 4
        page.screenshot(path=str(ARTIFACTS / "dashboard-compare.png"), full_page=True)
        # The selection is in the URL: a link to it opens the same comparison in a fresh page.
        shared = browser.new_page(viewport={"width": 1400, "height": 900})
        shared.goto(f"{info.url}/dashboard")
        shared.evaluate(f"localStorage.setItem('trainyard-token', {json.dumps(info.token)})")
        shared.goto(page.url)
        shared.wait_for_function(f"() => {drawn('train_loss', label[job_id] + ' · train_loss')} === 600", timeout=30_000)

        # A one-time link signs a fresh browser in (`trainyard open`, `trainyard up`): the code leaves
        # the address at once, the page holds a session of its own, and the link works only once.
        with Client(server=info.url, token=info.token) as admin:
            link, _ = admin.login_link()
        linked = browser.new_page(viewport={"width": 1400, "height": 900})
        linked.goto(link)
        linked.locator("tr", has=linked.locator("a", has_text="watched-run")).wait_for()
        assert "login=" not in linked.url
        assert linked.evaluate("localStorage.getItem('trainyard-token')").startswith("tyb_")
        reused = browser.new_page(viewport={"width": 1400, "height": 900})
        reused.goto(link)
        reused.locator("form.login p.error", has_text="used already").wait_for()

        # The workers page shows the embedded worker host, online and idle again.
        page.click("a[href='#/workers']")
        worker_row = page.locator("tr", has_text="local-0")
        worker_row.wait_for()
        slots = client.get("/v1/workers").json()[0]["slots"]
        page.wait_for_function(f"() => document.body.innerText.includes('0 / {slots}')", timeout=30_000)
        assert "yes" in worker_row.inner_text()
        page.screenshot(path=str(ARTIFACTS / "dashboard-workers.png"), full_page=True)

        # The usage page shows the device-hours the API counts, per user and per job, the jobs finished,
        # and each team's quota and what it holds.
        assert client.post("/v1/teams", json={"name": "vision", "quota": {"cpu": 2}}).status_code == 201
        usage = client.get("/v1/usage").json()
        page.click("a[href='#/usage']")
        [user] = usage["users"]
        user_row = page.locator("#usage-users tr", has_text=user["user"])  # the users table; the jobs table names owners too
        user_row.wait_for()
        assert "2 cpu" in page.locator("#teams tr", has_text="vision").inner_text()
        assert f"{user['device_seconds'] / 3600:.3f}" in user_row.inner_text()
        assert {j["job_id"] for j in usage["jobs"]} >= {job_id, other_id} and all(j["device_seconds"] > 0 for j in usage["jobs"])
        page.screenshot(path=str(ARTIFACTS / "dashboard-usage.png"), full_page=True)

        # The jobs table: searched by name or owner, and filtered by status, by the server; each job's run time.
        page.click("a[href='#/jobs']")
        page.locator("#job-search").fill("HIGHER")
        page.wait_for_function("() => document.querySelectorAll('table tr').length === 2")  # its header and the one match
        assert "higher-lr" in page.inner_text("table") and "watched-run" not in page.inner_text("table")
        page.locator("#job-search").fill("")
        page.select_option("#job-status", "cancelled")
        page.locator("#no-match").wait_for()
        page.select_option("#job-status", "")
        watched_row = page.locator("tr", has=page.locator("a", has_text="watched-run"))
        watched_row.wait_for()
        assert re.search(r"\b\d+s\b", watched_row.inner_text()), watched_row.inner_text()  # its run time

        overview_clone_and_cancel(page, client, other_id)

        # Dark, at a phone's width: nothing wider than the screen, the page dark.
        phone = browser.new_page(viewport={"width": 390, "height": 844}, color_scheme="dark")
        phone.goto(f"{info.url}/dashboard")
        phone.evaluate(f"localStorage.setItem('trainyard-token', {json.dumps(info.token)})")
        for where in [f"#/jobs/{job_id}", f"#/compare/{job_id},{other_id}", "#/jobs"]:
            phone.goto(f"{info.url}/dashboard{where}")
            phone.wait_for_function("() => document.querySelector('[data-chart], table')", timeout=30_000)
            phone.wait_for_timeout(500)  # charts size themselves to their boxes
            assert phone.evaluate("document.documentElement.scrollWidth") <= 390, where
            name = "dashboard-phone-dark-" + where.strip("#/").replace("/", "-").replace(",", "-") + ".png"
            phone.screenshot(path=str(ARTIFACTS / name), full_page=True)
        assert phone.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(15, 18, 23)"
        client.close()
