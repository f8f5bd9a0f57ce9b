"""The dashboard page's weight, and the time from navigation to its first drawn chart of a 1M-point job.

    PYTHONPATH=$PWD .venv/bin/python bench/dashboard_page.py [--points 1000000] [--loads 5]

Weight: the page's HTML, script and styles as served, vendored uPlot included, each gzipped (what
a browser fetches, compressed by any proxy; the API itself sends them as they are). Target ≤ 150 KB.

Time: a job of `--points` points over 7 series (bench/metrics_query.py's fill, PostgreSQL), the
API under uvicorn on a local port, Debian's Chromium through Playwright: from navigation start
(the token already in the browser) to a chart that has drawn points, `--loads` times after one
warm-up. The peer, in the same browser and runs, is that page's own GET /metrics request (the floor
under any page that draws the server's downsampled series). Target ≤ 1 s. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402
import uvicorn  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from bench.metrics_query import fill  # noqa: E402
from bench.scratch import postgres_database  # noqa: E402
from service.api.main import create_app  # noqa: E402
from service.db.accounts import create_user  # noqa: E402
from service.db.metric_buckets import refresh_metric_buckets  # noqa: E402
from service.db.session import session_factory  # noqa: E402
from common.settings import Settings  # noqa: E402
from tests.helpers import job_spec  # noqa: E402
from workers.supervisor import free_port  # noqa: E402

STATIC = REPO / "service" / "static"
PAGE_FILES = ["dashboard.html", "dashboard.js", "vendor/uplot/uPlot.iife.min.js", "vendor/uplot/uPlot.min.css"]
FIRST_CHART = "() => [...document.querySelectorAll('[data-chart]')].some(c => Object.values(JSON.parse(c.dataset.points || '{}')).some(n => n > 0))"


def page_weight() -> dict[str, int]:
    return {name: len(gzip.compress((STATIC / name).read_bytes(), 9)) for name in PAGE_FILES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    weight = page_weight()

    with postgres_database() as url, tempfile.TemporaryDirectory() as tmp:
        with session_factory(url)() as session:
            owner, token = create_user(session, "bench")
        with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as connection:
            job_id = fill(connection, owner.id, job_spec().model_dump(mode="json"), args.points, other_jobs=0)
        with session_factory(url)() as session:
            refresh_metric_buckets(session, job_id)
            session.commit()

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(Settings(data_dir=Path(tmp), database_url=url)), port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        first_chart_ms, metrics_ms = [], []
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{base}/dashboard")
            page.evaluate(f"localStorage.setItem('trainyard-token', {json.dumps(token)})")
            for load in range(args.loads + 1):
                page.goto("about:blank")
                page.goto(f"{base}/dashboard#/jobs/{job_id}")
                page.wait_for_function(FIRST_CHART, timeout=60_000)
                drawn = page.evaluate("performance.now()")  # since this navigation started
                request = page.evaluate("performance.getEntriesByType('resource').find(e => e.name.includes('/metrics?')).duration")
                if load:  # the first warms up the server's connections and caches
                    first_chart_ms.append(drawn)
                    metrics_ms.append(request)
            browser.close()
        server.should_exit = True

    print(json.dumps({
        "benchmark": "dashboard_page",
        "machine": f"{os.cpu_count()} CPU cores",
        "page_gzip_bytes": weight,
        "page_gzip_kb_total": round(sum(weight.values()) / 1024, 1),
        "target_page_kb": 150,
        "job_points": args.points,
        "loads": args.loads,
        "first_chart_ms": {"median": round(statistics.median(first_chart_ms)), "max": round(max(first_chart_ms))},
        "peer_metrics_request_ms": {"median": round(statistics.median(metrics_ms)), "max": round(max(metrics_ms))},
        "target_first_chart_ms": 1000,
    }))


if __name__ == "__main__":
    main()
