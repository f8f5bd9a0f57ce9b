"""A sweep on the dashboard page, in a real browser: the sweeps table, then a sweep's trials
(parameters, status, objective), its best trial and spec, and the trials' curves overlaid, kept up
to date while the sweep runs. The trials are run by the test in the scheduler's and workers' place
(tests/sweep_helpers.py), so their curves are known."""

from __future__ import annotations

import json

import httpx
import pytest

from service.api.main import create_app
from service.db.accounts import create_user
from service.db.session import session_factory
from service.sweeps import advance_sweep
from tests.browser import ARTIFACTS
from tests.client.serve import serve_app
from tests.helpers import auth
from tests.sweep_helpers import EVAL_EVERY, MAX_STEPS, Workers, run_sweep, sweep_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def database_url(sqlite_url) -> str:
    return sqlite_url


def test_a_sweeps_trials_best_trial_and_curves_show_and_grow_while_it_runs(browser, settings):
    with session_factory(settings.resolved_database_url)() as session:
        _, token = create_user(session, "alice")
    with serve_app(create_app(settings)) as url:
        response = httpx.post(f"{url}/v1/sweeps", json=sweep_spec(budget={"max_trials": 4, "max_concurrent": 2}), headers=auth(token))
        assert response.status_code == 201, response.text
        sweep_id = response.json()["id"]
        # Half way: the first two trials placed and one round of metrics reported.
        workers = Workers(settings)
        with workers.sessions() as session:
            advance_sweep(session, sweep_id, settings)
        workers.round()

        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{url}/dashboard")
        page.evaluate(f"localStorage.setItem('trainyard-token', {json.dumps(token)})")
        page.goto(f"{url}/dashboard#/sweeps")
        row = page.locator("tr", has_text="search")
        row.wait_for()
        assert "running" in row.inner_text() and "eval_loss (min)" in row.inner_text()
        row.locator("a").click()
        page.wait_for_function("() => document.querySelectorAll('[data-chart=\"eval_loss\"]').length === 1", timeout=10_000)
        assert page.locator("table").first.locator("tr:has(td)").count() == 2
        assert points(page, "eval_loss") == {"t0 · eval_loss": 1, "t1 · eval_loss": 1}

        # The rest of the sweep runs; the page follows without a reload.
        ended, _ = run_sweep(settings, sweep_id, workers=workers)
        assert ended.status == "succeeded", ended.failure_reason
        page.wait_for_function("() => document.querySelector('h2 .status').textContent === 'succeeded'", timeout=20_000)
        page.wait_for_function("() => document.querySelector('table').querySelectorAll('tr:has(td)').length === 4", timeout=20_000)
        page.wait_for_function(
            "() => Object.values(JSON.parse(document.querySelector('[data-chart=\"eval_loss\"]').dataset.points)).every(n => n === %d)"
            % (MAX_STEPS // EVAL_EVERY), timeout=20_000)
        sweep = httpx.get(f"{url}/v1/sweeps/{sweep_id}", headers=auth(token)).json()
        assert set(points(page, "eval_loss")) == {f"t{n} · eval_loss" for n in range(4)}
        best = page.inner_text("#best-trial")
        assert f"t{sweep['best_trial']}" in best and str(sweep["trials"][sweep["best_trial"]]["job_id"]) in best
        page.click("details summary")
        assert json.loads(page.inner_text("details pre")) == sweep["best_spec"]
        # The trials table names each trial's parameters and its objective value.
        table = page.locator("table").first
        for trial in sweep["trials"]:
            cells = table.locator("tr:has(td)").nth(trial["number"]).inner_text()
            # The value as the page rounds it (4 significant digits), compared on the first 3.
            assert str(trial["params"]["optimizer.lr"]) in cells and f"{trial['value']:.4}"[:4] in cells and trial["status"] in cells
        page.screenshot(path=str(ARTIFACTS / "dashboard-sweep.png"), full_page=True)


def points(page, chart: str) -> dict[str, int]:
    return json.loads(page.get_attribute(f'[data-chart="{chart}"]', "data-points"))
