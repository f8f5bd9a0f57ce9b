"""A hostile user's jobs against the sandbox (workers/sandbox.py), on both backend pairs: a `script`
job and a `custom` plugin (tests/e2e/sandbox_probe.py) try to read the token, the database, another
user's upload and checkpoint, other processes' environments; to run a library of theirs outside the
sandbox (LD_PRELOAD in the job's env); to connect to the database, broker and API; to write into the
service's directories; to start threads without bound. Every try fails and the job's logs say so; a
job over its memory limit fails saying so, one asking for nothing is held to its slot's core and
stopped when it writes past its disk limit; the worker lives on, and the other user's checkpoint is
untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from api_schemas.manifest import MODEL_FILE, checkpoint_name
from service.db.accounts import create_user
from service.db.session import session_factory
from stack.embedded import embedded_stack
from common.settings import Settings
from tests.e2e.test_end_to_end import wait_for
from tests.e2e.test_scripts import upload_code
from tests.helpers import tiny_spec
from workers.limits import own_group
from workers.sandbox import SANDBOX_UID
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(600)

PROBE = Path(__file__).with_name("sandbox_probe.py")
REPO = PROBE.parents[2]
REDIS_PORT, POSTGRES_PORT = 6379, 5432


# Reaching the control plane is tried on both backends (PostgreSQL and Redis are there to reach on
# one); the limits are the host's cgroups' alone, tried on the embedded one.
ON_ONE_BACKEND = pytest.mark.parametrize("yard", ["sqlite+sqla-transport"], indirect=True)


@pytest.fixture(scope="module", params=["sqlite+sqla-transport", "postgres+redis"])
def yard(request, tmp_path_factory):
    """(admin client, a code-running non-admin's client, the stack, the admin's upload id, job id and checkpoint).
    One per backend pair for the module's tests: each hostile job meets a service the ones before tried."""
    urls = {}
    if request.param == "postgres+redis":
        urls = {"database_url": request.getfixturevalue("module_postgres_url"), "broker_url": request.getfixturevalue("module_redis_url")}
    data_dir = tmp_path_factory.mktemp("sandbox") / "yard"
    (data_dir / "plugins").mkdir(parents=True)
    shutil.copy(PROBE, data_dir / "plugins" / PROBE.name)  # installed by the operator, run by anyone
    with embedded_stack(data_dir, free_port(), workers=1, devices="cpu:2", **urls) as info:
        settings = Settings(data_dir=data_dir, database_url=urls.get("database_url"))
        with session_factory(settings.resolved_database_url)() as session:
            _, mallory_token = create_user(session, "mallory", can_run_code=True)
        admin = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30)
        mallory = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {mallory_token}"}, timeout=30)
        upload = admin.post("/v1/datasets", params={"name": "secret.txt"}, content=b"the admin's data " * 100)
        assert upload.status_code == 201, upload.text
        job = admin.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 6, "checkpoint.every_steps": 6})).json()
        assert wait_for(admin, job["id"], {"succeeded", "failed"})["status"] == "succeeded"
        checkpoint = admin.get(f"/v1/jobs/{job['id']}/checkpoints").json()[-1]
        yield admin, mallory, info, settings, upload.json()["id"], job["id"], checkpoint
        admin.close()
        mallory.close()


def targets(info, settings: Settings, upload_id: int, job_id: int, checkpoint: dict) -> dict:
    data_dir, artifacts = settings.data_dir, settings.resolved_artifact_root
    return {
        "read": {
            "the token file": str(data_dir / "token"),
            "the database": str(data_dir / "trainyard.db"),
            "the broker file": str(data_dir / "broker.db"),
            "another user's upload": str(settings.resolved_data_root / "uploads" / str(upload_id)),
            "another job's checkpoint": str(artifacts / "jobs" / str(job_id) / "checkpoints" / checkpoint_name(checkpoint["step"]) / MODEL_FILE),
        },
        "list": {
            "the artifact store": str(artifacts / "jobs"),
            "other jobs' runs": str(settings.resolved_work_root / f"job-{job_id}"),
            # The project's own code but what the training imports (api_schemas, workers).
            **{f"the project's {package}": str(REPO / package) for package in ("service", "common", "stack", "trainyard")},
        },
        "write": {
            "the data directory": str(data_dir),
            "the plugin directory": str(settings.resolved_plugin_dir),
            "the artifact store": str(artifacts),
        },
        "connect": {"the API": int(info.url.rpartition(":")[2]), "PostgreSQL": POSTGRES_PORT, "Redis": REDIS_PORT},
    }


def logs_of(client: httpx.Client, job_id: int) -> list[str]:
    return [line["line"] for line in client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 1000}).json()["lines"]]


def run_probe(mallory: httpx.Client, spec: dict) -> list[str]:
    response = mallory.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job = wait_for(mallory, response.json()["id"], {"succeeded", "failed", "cancelled"})
    lines = logs_of(mallory, job["id"])
    assert job["status"] == "succeeded", (job["failure_reason"], lines)
    return lines


def assert_all_blocked(lines: list[str], probe_targets: dict) -> None:
    leaks = [line for line in lines if line.startswith("LEAK")]
    assert not leaks, leaks
    blocked = {line.partition(":")[0].removeprefix("BLOCKED ") for line in lines if line.startswith("BLOCKED")}
    expected = {f"{verb} {name}" for verb in ("read", "list", "write", "connect") for name in probe_targets[verb]}
    expected |= {"read /proc/1/environ", "see other processes' credentials", "inherit credentials", "start threads without bound"}
    assert expected <= blocked, (expected - blocked, lines)


def assert_the_service_is_unharmed(admin: httpx.Client, settings: Settings, checkpoint: dict) -> None:
    assert not list(settings.data_dir.rglob("written-by-a-job"))
    download = admin.get(f"/v1/checkpoints/{checkpoint['id']}/download")
    assert download.status_code == 200 and hashlib.sha256(download.content).hexdigest() == checkpoint["sha256"]
    assert all(host["online"] and host["sandbox"].startswith("bubblewrap") for host in admin.get("/v1/workers").json())


# A library whose constructor runs in every program that preloads it: it says where it ran, and
# leaves a file at a host path (which exists only outside the sandbox) if it can.
PRELOADED_LIBRARY = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void preloaded(void) {
    char exe[512] = {0};
    readlink("/proc/self/exe", exe, sizeof exe - 1);
    fprintf(stderr, "PRELOADED uid=%d exe=%s\n", (int)getuid(), exe);
    FILE *witness = fopen(getenv("WITNESS") ? getenv("WITNESS") : "/nonexistent", "a");
    if (witness) { fprintf(witness, "uid=%d exe=%s\n", (int)getuid(), exe); fclose(witness); }
}
"""


def preloaded_library(directory: Path) -> Path:
    source, library = directory / "evil.c", directory / "evil.so"
    source.write_text(PRELOADED_LIBRARY)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def test_a_hostile_script_job_reaches_nothing_that_is_not_its_own(yard, tmp_path):
    admin, mallory, info, settings, upload_id, job_id, checkpoint = yard
    probe_targets = targets(info, settings, upload_id, job_id, checkpoint)
    # Its env preloads its own library: before, the worker's shell and bwrap ran it as root on the host.
    witness = tmp_path / "preloaded-on-the-host"
    code = upload_code(mallory, PROBE, preloaded_library(tmp_path))
    spec = {"name": "probe", "script": {
        "entrypoint": PROBE.name, "args": [json.dumps(probe_targets)], "code": {"upload_id": code},
        "env": {"LD_PRELOAD": "./evil.so", "WITNESS": str(witness)},
    }}
    lines = run_probe(mallory, spec)
    assert_all_blocked(lines, probe_targets)
    assert not witness.exists(), witness.read_text()
    preloaded = {line.partition("exe=")[0].strip() for line in lines if line.startswith("PRELOADED")}
    assert preloaded == {f"PRELOADED uid={SANDBOX_UID}"}, lines  # applied, to the job's own processes only
    assert_the_service_is_unharmed(admin, settings, checkpoint)


def test_a_hostile_custom_plugin_reaches_nothing_that_is_not_its_own(yard):
    admin, mallory, info, settings, upload_id, job_id, checkpoint = yard
    probe_targets = targets(info, settings, upload_id, job_id, checkpoint)
    spec = {
        "name": "probe-plugin",
        "model": {"kind": "custom", "entrypoint": "sandbox_probe:train", "config": probe_targets},
        "training": {"max_steps": 1, "micro_batch_size": 1},
        "optimizer": {"lr": 0.001},
        "schedule": {"name": "constant"},
    }
    assert_all_blocked(run_probe(mallory, spec), probe_targets)
    assert_the_service_is_unharmed(admin, settings, checkpoint)


@ON_ONE_BACKEND
def test_a_job_over_its_memory_limit_fails_saying_so_and_the_worker_lives_on(yard, tmp_path):
    admin, mallory, _, settings, _, _, checkpoint = yard
    hog = tmp_path / "hog.py"
    hog.write_text('ballast = b"x" * (3 << 30)\nprint("LEAK allocated 3 GB")\n')
    spec = {"name": "hog", "script": {"entrypoint": "hog.py", "code": {"upload_id": upload_code(mallory, hog)}},
            "resources": {"memory_gb": 1}, "max_restarts": 0}
    response = mallory.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job = wait_for(mallory, response.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "failed"
    assert "out of memory" in job["failure_reason"] and "resources.memory_gb" in job["failure_reason"], job["failure_reason"]
    assert not [line for line in logs_of(mallory, job["id"]) if line.startswith("LEAK")]
    after = admin.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 6, "checkpoint.every_steps": 6})).json()
    assert wait_for(admin, after["id"], {"succeeded", "failed"})["status"] == "succeeded"
    assert_the_service_is_unharmed(admin, settings, checkpoint)


# Four busy processes for a 1-slot job, then a file written without end.
GREEDY = """
import multiprocessing, time

def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass

if __name__ == "__main__":
    workers = [multiprocessing.Process(target=spin, args=(8,)) for _ in range(4)]
    for worker in workers:
        worker.start()
    print("GREEDY spinning", flush=True)
    for worker in workers:
        worker.join()
    with open("filler.bin", "wb") as out:
        for megabytes in range(1, 100_000):
            out.write(b"x" * 2**20)
            out.flush()
            if megabytes % 100 == 0:
                print(f"GREEDY wrote {megabytes} MB", flush=True)
"""


def cpu_quota_of(script: str) -> str:
    """The CPU quota the kernel holds the processes running `script` to (cgroup v2's cpu.max, v1's
    quota/period), read from their attempt's own cgroup beside the worker's (workers/limits.py)."""
    [pid, *_] = subprocess.run(["pgrep", "-f", script], capture_output=True, text=True).stdout.split()
    cgroups = dict(line.split(":", 2)[1:] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    path = next((path for controllers, path in cgroups.items() if "cpu" in controllers.split(",")), cgroups.get(""))  # v1, else v2
    group = own_group("cpu") / Path(path).name
    if (group / "cpu.max").exists():
        return (group / "cpu.max").read_text().strip()
    return f"{(group / 'cpu.cfs_quota_us').read_text().strip()} {(group / 'cpu.cfs_period_us').read_text().strip()}"


@pytest.mark.skipif(own_group("cpu") is None, reason="no writable cpu cgroup here: the worker leaves CPU unbounded")
@ON_ONE_BACKEND
def test_a_job_asking_for_nothing_is_held_to_its_slots_cores_and_stopped_past_its_disk_limit(yard, tmp_path):
    admin, mallory, _, settings, _, _, checkpoint = yard
    greedy = tmp_path / "greedy.py"
    greedy.write_text(GREEDY)
    spec = {"name": "greedy", "script": {"entrypoint": "greedy.py", "code": {"upload_id": upload_code(mallory, greedy)}},
            "resources": {"disk_gb": 0.25}, "max_restarts": 0}
    response = mallory.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    # While its four processes spin, its cgroup holds them to one core: the slot's share of the host's two.
    deadline = time.monotonic() + 120
    while "GREEDY spinning" not in logs_of(mallory, job_id):
        assert time.monotonic() < deadline, mallory.get(f"/v1/jobs/{job_id}").json()
        time.sleep(0.2)
    assert cpu_quota_of("greedy.py") == "100000 100000", "one core of the two: the slot's share"
    job = wait_for(mallory, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "failed" and "not retried: disk limit: its directory on local-0 held " in job["failure_reason"], job["failure_reason"]
    assert "over its 0.25 GB (resources.disk_gb" in job["failure_reason"], job["failure_reason"]
    assert "GREEDY wrote 200 MB" in logs_of(mallory, job_id)
    assert_the_service_is_unharmed(admin, settings, checkpoint)
