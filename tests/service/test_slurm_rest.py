"""The Slurm backend's REST way in (service/backends/slurm_rest.py) against a real slurmrestd with
JWT auth on a throwaway two-node cluster: it submits the batch job the commands would (options as
fields, the environment given whole), reads the queue, cancels, describes the partition as sinfo
does, and says what is wrong with a job Slurm refuses and with an expired token."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from service.backends.slurm_commands import BatchJob, SlurmCommands, SlurmError
from service.backends.slurm_rest import SlurmRest
from tests.slurm_cluster import SlurmCluster, SlurmUnavailable

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster():
    try:
        cluster = SlurmCluster.start_new()
        cluster.url = cluster.start_rest()
    except SlurmUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no Slurm cluster: {exc}")
        pytest.skip(f"no Slurm cluster: {exc}")
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # for the commands compared against
    yield cluster
    os.environ.pop("SLURM_CONF") if saved is None else os.environ.update(SLURM_CONF=saved)
    cluster.stop()


def rest(cluster, tmp_path: Path, lifespan_seconds: int = 600) -> SlurmRest:
    token_file = tmp_path / "jwt"
    token_file.write_text(cluster.token(lifespan_seconds) + "\n")
    return SlurmRest(cluster.url, cluster.user, token_file, tmp_path)


def batch_job(tmp_path: Path, name: str, command: list[str], nodes: int = 2) -> BatchJob:
    return BatchJob(
        name=name, partition="batch", nodes=nodes, cpus_per_node=1, gpus_per_node=0, memory_gb=None, minutes=5,
        output=tmp_path / "slurm-%j.out", environment={"PATH": os.environ["PATH"], "GREETING": "it's a 'quoted' one"}, command=command,
    )


def wait_for_state(slurm: SlurmRest, job_id: str, states: set[str]) -> str:
    deadline = time.monotonic() + 60
    while (state := slurm.queue()[job_id].state) not in states:
        assert time.monotonic() < deadline, f"Slurm job {job_id} still {state}"
        time.sleep(0.2)
    return state


def test_a_batch_job_runs_on_both_nodes_with_its_environment_and_is_listed_by_name(cluster, tmp_path):
    slurm = rest(cluster, tmp_path)
    job_id = slurm.submit(batch_job(tmp_path, "rest-hello", ["/bin/sh", "-c", 'echo "$SLURM_NODEID: $GREETING"']))
    assert slurm.queue()[job_id].name == "rest-hello"
    assert wait_for_state(slurm, job_id, {"COMPLETED", "FAILED"}) == "COMPLETED"
    lines = (tmp_path / f"slurm-{job_id}.out").read_text().splitlines()
    assert sorted(lines) == ["0: it's a 'quoted' one", "1: it's a 'quoted' one"]


def test_a_cancelled_job_ends_cancelled(cluster, tmp_path):
    slurm = rest(cluster, tmp_path)
    job_id = slurm.submit(batch_job(tmp_path, "rest-sleeper", ["sleep", "300"], nodes=1))
    wait_for_state(slurm, job_id, {"RUNNING"})
    slurm.cancel(job_id)
    assert wait_for_state(slurm, job_id, {"CANCELLED", "COMPLETED", "FAILED"}) == "CANCELLED"


def test_the_partition_reads_as_sinfo_reads_it(cluster, tmp_path):
    assert rest(cluster, tmp_path).partition("batch") == SlurmCommands().partition("batch")
    with pytest.raises(SlurmError, match="no partition 'nope'"):
        rest(cluster, tmp_path).partition("nope")


def test_a_job_slurm_refuses_and_an_expired_token_say_why(cluster, tmp_path):
    with pytest.raises(SlurmError) as refused:  # three nodes of a two-node partition
        rest(cluster, tmp_path).submit(batch_job(tmp_path, "rest-too-big", ["true"], nodes=3))
    assert not refused.value.transient and "configuration not available" in str(refused.value)

    expiring = rest(cluster, tmp_path, lifespan_seconds=1)
    time.sleep(2)
    with pytest.raises(SlurmError) as expired:
        expiring.queue()
    assert expired.value.transient and f"the token in {tmp_path / 'jwt'} expired at" in str(expired.value)
    # A new token written to the same file is read at the next call: no restart.
    (tmp_path / "jwt").write_text(cluster.token())
    assert isinstance(expiring.queue(), dict)
