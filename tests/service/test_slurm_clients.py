"""The Slurm backend's two ways in, against a real throwaway two-node cluster: Slurm's commands
(service/backends/slurm_commands.py) and slurmrestd with JWT auth (service/backends/slurm_rest.py).
Each submits the batch job (the REST one as fields, its environment given whole), reads the queue,
cancels, describes the partition (the two alike), and says what is wrong with a job Slurm refuses;
the REST one also with an expired token, and takes a renewed one with no restart. The pool's
lifecycle end to end is tests/e2e/test_slurm.py's, through slurmrestd."""

from __future__ import annotations

import dataclasses
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


@pytest.fixture(params=["commands", "rest"])
def slurm(request, cluster, tmp_path) -> SlurmCommands | SlurmRest:
    return SlurmCommands() if request.param == "commands" else rest(cluster, tmp_path)


def batch_job(tmp_path: Path, name: str, command: list[str], nodes: int = 2) -> BatchJob:
    return BatchJob(
        name=name, partition="batch", nodes=nodes, cpus_per_node=1, gpus_per_node=0, memory_gb=None, minutes=5,
        output=tmp_path / "slurm-%j.out", environment={"PATH": os.environ["PATH"], "GREETING": "it's a 'quoted' one"}, command=command,
    )


def wait_for_state(slurm: SlurmCommands | SlurmRest, job_id: str, states: set[str]) -> str:
    deadline = time.monotonic() + 60
    while (state := slurm.queue()[job_id].state) not in states:
        assert time.monotonic() < deadline, f"Slurm job {job_id} still {state}"
        time.sleep(0.2)
    return state


def test_a_batch_job_runs_on_both_nodes_with_its_environment_and_is_listed_by_name(slurm, tmp_path):
    job_id = slurm.submit(batch_job(tmp_path, "hello", ["/bin/sh", "-c", 'echo "$SLURM_NODEID: $GREETING"']))
    assert slurm.queue()[job_id].name == "hello"
    assert wait_for_state(slurm, job_id, {"COMPLETED", "FAILED"}) == "COMPLETED"
    lines = (tmp_path / f"slurm-{job_id}.out").read_text().splitlines()
    assert sorted(lines) == ["0: it's a 'quoted' one", "1: it's a 'quoted' one"]


def test_a_cancelled_job_ends_cancelled(slurm, tmp_path):
    job_id = slurm.submit(batch_job(tmp_path, "sleeper", ["sleep", "300"], nodes=1))
    wait_for_state(slurm, job_id, {"RUNNING"})
    slurm.cancel(job_id)
    assert wait_for_state(slurm, job_id, {"CANCELLED", "COMPLETED", "FAILED"}) == "CANCELLED"


def test_a_job_of_a_user_slurmrestd_cannot_name_is_still_seen_and_cancelled(cluster, tmp_path):
    # The README's `scontrol token username=trainyard` for an account the controller's host doesn't
    # resolve: Slurm runs the job, slurmrestd lists it with `user_name` null. It was left out of the
    # queue, taken for gone, and every try submitted again, all of them left pending.
    token_file = tmp_path / "jwt"
    token_file.write_text(cluster.run("scontrol", "token", "username=trainyard-unknown", "lifespan=600"))
    slurm = SlurmRest(cluster.url, "trainyard-unknown", token_file, tmp_path)
    job_id = slurm.submit(batch_job(tmp_path, "nameless", ["sleep", "300"], nodes=1))
    assert slurm.queue()[job_id].name == "nameless"
    slurm.cancel(job_id)
    assert wait_for_state(slurm, job_id, {"CANCELLED", "COMPLETED", "FAILED"}) == "CANCELLED"


def test_the_partition_reads_as_sinfo_reads_it(cluster, tmp_path):
    assert rest(cluster, tmp_path).partition("batch") == SlurmCommands().partition("batch")
    assert SlurmCommands().partition("batch")["max_minutes"] is None  # no time limit (MaxTime=UNLIMITED)
    cluster.run("scontrol", "update", "PartitionName=batch", "MaxTime=1-12:30:00")
    try:
        assert rest(cluster, tmp_path).partition("batch")["max_minutes"] == SlurmCommands().partition("batch")["max_minutes"] == 36 * 60 + 30
    finally:
        cluster.run("scontrol", "update", "PartitionName=batch", "MaxTime=UNLIMITED")
    with pytest.raises(SlurmError, match="no partition 'nope'"):
        rest(cluster, tmp_path).partition("nope")


def test_a_job_slurm_cant_run_waits_saying_why_and_one_it_refuses_says_why(slurm, tmp_path):
    # Three nodes of a two-node partition: taken, and pending with Slurm's reason (admission refuses it first).
    job_id = slurm.submit(batch_job(tmp_path, "too-big", ["true"], nodes=3))
    assert slurm.queue()[job_id].shown == "PENDING (PartitionConfig)"
    slurm.cancel(job_id)
    with pytest.raises(SlurmError) as refused:  # a partition the cluster doesn't have
        slurm.submit(dataclasses.replace(batch_job(tmp_path, "nowhere", ["true"]), partition="nope"))
    assert not refused.value.transient and "nvalid partition" in str(refused.value)


def test_an_expired_token_is_named_and_a_renewed_one_taken_with_no_restart(cluster, tmp_path):
    expiring = rest(cluster, tmp_path, lifespan_seconds=1)
    time.sleep(2)
    with pytest.raises(SlurmError) as expired:
        expiring.queue()
    assert expired.value.transient and f"the token in {tmp_path / 'jwt'} expired at" in str(expired.value)
    # A new token written to the same file is read at the next call: no restart.
    (tmp_path / "jwt").write_text(cluster.token())
    assert isinstance(expiring.queue(), dict)
