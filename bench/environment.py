"""Per-job environments (`environment.pip`): what preparing one costs a job's start.

    PYTHONPATH=$PWD .venv/bin/python bench/environment.py [--rounds 20] [--pypi six==1.17.0]

`EnvironmentCache.acquire` as the worker calls it before an attempt's launch:
  - cache hit: the environment is built already (median of `--rounds`, each acquire + release; the
    cache object is the worker's, made once, so the worker environment's fingerprint is read once;
    that first read is reported too, as `first_key_s`);
  - cold build: one small package, a wheel the bench makes itself in a local find-links directory
    (offline, nothing downloaded), into an empty cache; with `--pypi NAME==VERSION`, also one from
    PyPI (download included; needs the network).
The peer is the floor under any uv-built environment: `uv venv` + `uv pip install` of the same
wheel, no layering, no lock, no cache. Prints one JSON line; ratio = cold build / peer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.wheels import make_wheel  # noqa: E402
from workers.environments import EnvironmentCache  # noqa: E402

MAX_BYTES = 10**11


def cold_build(root: Path, requirement: str, **index) -> float:
    started = time.monotonic()
    EnvironmentCache(root, MAX_BYTES, **index).acquire([requirement], lambda line: None).release()
    return time.monotonic() - started


def bare_uv(root: Path, wheels: Path, requirement: str) -> float:
    from uv import find_uv_bin

    started = time.monotonic()
    subprocess.run([find_uv_bin(), "venv", "-q", "--python", sys.executable, str(root)], check=True)
    subprocess.run(
        [find_uv_bin(), "pip", "install", "-q", "--python", str(root / "bin" / "python"), "--no-cache", "--no-index",
         "--find-links", str(wheels), requirement],
        check=True,
    )
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--pypi", help="also a cold build of this requirement from PyPI, e.g. six==1.17.0")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        wheels = scratch / "wheels"
        make_wheel(wheels, "benchpkg", "1.0", "VALUE = 1\n")
        local = {"find_links": [str(wheels)], "no_index": True}

        cold, peer = [], []
        for round_ in range(3):  # alternating, each into an empty cache
            cold.append(cold_build(scratch / f"cold-{round_}", "benchpkg==1.0", **local))
            peer.append(bare_uv(scratch / f"bare-{round_}", wheels, "benchpkg==1.0"))

        cache = EnvironmentCache(scratch / "cold-0", MAX_BYTES, **local)
        started = time.monotonic()
        cache.key(["benchpkg==1.0"])
        first_key = time.monotonic() - started
        hits = []
        for _ in range(args.rounds):
            started = time.monotonic()
            cache.acquire(["benchpkg==1.0"], lambda line: None).release()
            hits.append(time.monotonic() - started)

        result = {
            "benchmark": "environment",
            "cache_hit_s": round(statistics.median(hits), 4),
            "cache_hit_max_s": round(max(hits), 4),
            "first_key_s": round(first_key, 4),
            "cold_build_local_wheel_s": round(statistics.median(cold), 3),
            "peer_bare_uv_s": round(statistics.median(peer), 3),
            "ratio": round(statistics.median(cold) / statistics.median(peer), 2),
            "target_cache_hit_s": 0.5,
        }
        if args.pypi:
            result["cold_build_pypi_s"] = round(cold_build(scratch / "pypi", args.pypi), 3)
            result["pypi_requirement"] = args.pypi
    print(json.dumps(result))


if __name__ == "__main__":
    main()
