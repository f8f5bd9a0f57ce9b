"""Checkpoint download throughput over HTTP, against reading the same file from disk.

    PYTHONPATH=$PWD .venv/bin/python bench/download_throughput.py [--size-mb 200] [--rounds 3]

A checkpoint with a `--size-mb` model.safetensors is put in the artifact store and recorded in the
database (SQLite: the database answers one query per download, it is not what is measured). The
API runs as its own process under uvicorn, as `trainyard api` does; the client downloads
/v1/checkpoints/{id}/download over a real loopback socket with httpx, streaming, and counts the
bytes (as trainyard.client does, less the writing and hashing). The peer reads the file from the
disk (O_DIRECT, past the page cache) in 1 MiB blocks; the same read from the page cache, where the
API finds the file, is reported beside it as the ceiling. Rounds alternate peer and download.
Target: ratio ≥ 0.8 against the disk read. Prints one JSON line. `--proxy nginx` puts
deploy/nginx/trainyard.conf in front, as docker-compose.yml does: the API checks access and answers
with X-Accel-Redirect, nginx sends the file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas.manifest import MODEL_FILE  # noqa: E402
from bench.scratch import sqlite_database  # noqa: E402
from service.db.accounts import create_user  # noqa: E402
from service.db.checkpoints import list_checkpoints, record_checkpoint  # noqa: E402
from service.db.jobs import create_job  # noqa: E402
from service.db.session import session_factory  # noqa: E402
from stack.embedded import stop_children, wait_healthy  # noqa: E402
from common.settings import Settings  # noqa: E402
from tests.helpers import job_spec, start_job  # noqa: E402
from tests.nginx import nginx_in_front  # noqa: E402
from workers.supervisor import free_port  # noqa: E402

BLOCK = 1 << 20


def read_file(path: Path, direct: bool) -> tuple[int, float]:
    """Read the whole file in 1 MiB blocks; `direct`: from the disk itself (O_DIRECT), not the page cache."""
    buffer = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT requires
    start = time.perf_counter()
    size = 0
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        while read := os.readv(fd, [buffer]):
            size += read
    finally:
        os.close(fd)
    return size, time.perf_counter() - start


def download(client: httpx.Client, checkpoint_id: int) -> tuple[int, float]:
    start = time.perf_counter()
    size = 0
    with client.stream("GET", f"/v1/checkpoints/{checkpoint_id}/download") as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():  # as trainyard.client.Client.download reads it
            size += len(chunk)
    return size, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--proxy", choices=["none", "nginx"], default="none",
                        help="nginx: download through deploy/nginx/trainyard.conf, the API redirecting (X-Accel-Redirect)")
    args = parser.parse_args()

    with sqlite_database() as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=url)
        sessions = session_factory(url)
        with sessions() as session:
            owner, token = create_user(session, "bench")
            job_id = create_job(session, owner, job_spec()).id
        claimed = start_job(settings, job_id)  # placed and claimed, as a worker that stores checkpoints

        relative = f"jobs/{job_id}/checkpoints/step-00000012"
        model = settings.resolved_artifact_root / relative / MODEL_FILE
        model.parent.mkdir(parents=True)
        with open(model, "wb") as f:  # incompressible, like trained weights
            for _ in range(args.size_mb):
                f.write(os.urandom(BLOCK))
        with sessions() as session:
            record_checkpoint(session, job_id, claimed.attempt_id, 12, relative, "0" * 64, model.stat().st_size, keep_last=1)
            checkpoint_id = list_checkpoints(session, job_id)[-1].id

        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "TRAINYARD_DATA_DIR": tmp, "TRAINYARD_DATABASE_URL": url}
        if args.proxy == "nginx":
            env["TRAINYARD_DOWNLOAD_REDIRECT_PREFIX"] = "/_artifacts/"
        api = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with contextlib.ExitStack() as stack:
            stack.callback(stop_children, [api])
            base = f"http://127.0.0.1:{port}"
            if args.proxy == "nginx":
                base = stack.enter_context(nginx_in_front(port, settings.resolved_artifact_root, Path(tmp) / "nginx", free_port()))
            client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120)
            wait_healthy(base, [api])
            api_cpu_before = sum(psutil.Process(api.pid).cpu_times()[:2])
            peer, cached, trainyard = [], [], []
            for _ in range(args.rounds):
                size, seconds = read_file(model, direct=True)
                peer.append(size / seconds / 1e6)
                size, seconds = read_file(model, direct=False)
                cached.append(size / seconds / 1e6)
                downloaded, seconds = download(client, checkpoint_id)
                assert downloaded == size, (downloaded, size)
                trainyard.append(size / seconds / 1e6)
            # What serving the bytes costs the API process (the proxy's own CPU is not counted).
            api_cpu_per_gb = (sum(psutil.Process(api.pid).cpu_times()[:2]) - api_cpu_before) / (args.rounds * size / 1e9)

    print(json.dumps({
        "benchmark": "download_throughput",
        "machine": f"{os.cpu_count()} CPU cores",
        "file_mb": round(size / 1e6),
        "proxy": args.proxy,
        "peer_disk_read_mb_per_s": round(statistics.median(peer)),
        "trainyard_http_mb_per_s": round(statistics.median(trainyard)),
        "ratio": round(statistics.median(trainyard) / statistics.median(peer), 3),
        "api_cpu_s_per_gb": round(api_cpu_per_gb, 3),
        "page_cache_read_mb_per_s": round(statistics.median(cached)),
        "ratio_to_page_cache": round(statistics.median(trainyard) / statistics.median(cached), 3),
        "rounds": {"peer": [round(x) for x in peer], "trainyard": [round(x) for x in trainyard]},
    }))


if __name__ == "__main__":
    main()
