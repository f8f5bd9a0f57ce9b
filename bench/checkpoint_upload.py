"""A checkpoint taken into the store by a host that doesn't mount it (through the API), against one
that does but sits on another filesystem (copied in and verified).

    PYTHONPATH=$PWD .venv/bin/python bench/checkpoint_upload.py [--size-mb 200] [--rounds 3]

A checkpoint of a `--size-mb` model.safetensors, a tenth of that in optimizer state and a small
file, with its manifest, as the training writes one. Trainyard: `StoreThroughApi.checkpoint` (the
worker's code for TRAINYARD_SHARED_ARTIFACT_STORE=false) sends it to the API, its own process under
uvicorn as `trainyard api` runs, over a loopback socket in 16 MiB parts, and has it sealed: every
byte hashed against the manifest, moved into the store. Peer: the shared host's take from another
filesystem: `shutil.copytree` into the store and every file checked against the manifest, the work
`ArtifactStore.ingest_checkpoint` does when it can't rename. Both end with the same verified item in
the store. Rounds alternate. Prints one JSON line; lower is better, no target (a network between the
host and the API, rather than loopback, sets the real figure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas.host_api import HostRegistration  # noqa: E402
from api_schemas.manifest import verify_manifest, write_manifest  # noqa: E402
from bench.scratch import sqlite_database  # noqa: E402
from service.db.accounts import create_user  # noqa: E402
from service.db.host_tokens import issue_host_token  # noqa: E402
from service.db.jobs import create_job  # noqa: E402
from service.db.session import session_factory  # noqa: E402
from service.scheduler import schedule_pass  # noqa: E402
from common.settings import Settings  # noqa: E402
from stack.embedded import stop_children, wait_healthy  # noqa: E402
from tests.helpers import job_spec  # noqa: E402
from workers.host_client import HostClient  # noqa: E402
from workers.store_access import StoreThroughApi  # noqa: E402
from workers.supervisor import free_port  # noqa: E402

BLOCK = 1 << 20


def write_random(path: Path, megabytes: float) -> None:
    with open(path, "wb") as f:  # incompressible, like trained weights
        for _ in range(int(megabytes)):
            f.write(os.urandom(BLOCK))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with sqlite_database() as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=url)
        store_root = settings.resolved_artifact_root
        source = Path(tmp) / "host" / "step-00000012"
        source.mkdir(parents=True)
        write_random(source / "model.safetensors", args.size_mb)
        write_random(source / "optimizer.bin", max(1, args.size_mb / 10))
        (source / "random_states_0.pkl").write_bytes(os.urandom(15_000))
        write_manifest(source, 12)
        size = sum(path.stat().st_size for path in source.iterdir())

        sessions = session_factory(url)
        with sessions() as session:
            owner, _ = create_user(session, "bench")
            create_job(session, owner, job_spec())
            host_token = issue_host_token(session, "far-host")

        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "TRAINYARD_DATA_DIR": tmp, "TRAINYARD_DATABASE_URL": url}
        api = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with contextlib.ExitStack() as stack:
            stack.callback(stop_children, [api])
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, [api])
            host = HostClient(base, host_token)
            host.register(HostRegistration(device="cpu", slots=1, address="127.0.0.1"))
            with sessions() as session:
                [(attempt_id, _)] = schedule_pass(session, settings)
            claimed = host.claim(attempt_id, "far-host:bench", "127.0.0.1:1")
            through_api = StoreThroughApi(host, Path(tmp) / "host" / "scratch")

            api_cpu, peer, trainyard = 0.0, [], []
            for round_number in range(args.rounds):
                # Peer: copied in from another filesystem and verified, as a shared host's take that can't rename.
                staging = store_root / f"peer-{round_number}"
                start = time.perf_counter()
                shutil.copytree(source, staging)
                verify_manifest(staging)
                peer.append(time.perf_counter() - start)
                shutil.rmtree(staging)

                cpu_before = sum(psutil.Process(api.pid).cpu_times()[:2])
                start = time.perf_counter()
                path, _, _ = through_api.checkpoint(claimed, source, 12 + round_number, f"step-{12 + round_number:08d}")
                trainyard.append(time.perf_counter() - start)
                api_cpu += sum(psutil.Process(api.pid).cpu_times()[:2]) - cpu_before
                assert (store_root / path / "model.safetensors").stat().st_size == (source / "model.safetensors").stat().st_size
                shutil.rmtree(store_root / path)

    print(json.dumps({
        "benchmark": "checkpoint_upload",
        "machine": f"{os.cpu_count()} CPU cores",
        "checkpoint_mb": round(size / 1e6),
        "peer_copy_and_verify_s": round(statistics.median(peer), 3),
        "trainyard_through_api_s": round(statistics.median(trainyard), 3),
        "ratio": round(statistics.median(trainyard) / statistics.median(peer), 3),
        "trainyard_mb_per_s": round(size / 1e6 / statistics.median(trainyard)),
        "api_cpu_s_per_gb": round(api_cpu / (args.rounds * size / 1e9), 3),
        "rounds": {"peer": [round(x, 3) for x in peer], "trainyard": [round(x, 3) for x in trainyard]},
    }))


if __name__ == "__main__":
    main()
