"""A Slurm pool as its backend describes it, the scheduler's side (no Slurm running: the pool as
last described; reading a real cluster is tests/service/test_slurm_clients.py's).

A partition's time limit (MaxTime): a job that asks for longer is refused at submit, naming the
field, and one without a limit of its own is handed over within the partition's. Before, sbatch
asked for Trainyard's default 168 hours, and Slurm kept the job pending for ever (PartitionTimeLimit).
A pool set to another partition is not listed with the old one's description meanwhile."""

from __future__ import annotations

import pytest

from api_schemas import JobSpec
from service.backends.slurm import RUNTIME_MARGIN_MINUTES, SlurmBackend
from service.backends.slurm_commands import SlurmCommands
from service.db.accounts import create_user
from service.db.pools import all_pools, record_pool
from service.db.session import session_factory
from tests.helpers import auth, tiny_spec

POOL = {"partition": "batch", "nodes": 2, "cpus_per_node": 2, "gpus_per_node": 0, "memory_mb": 2000, "max_minutes": 60}
IN_POOL = {"resources.pool": "slurm"}


@pytest.fixture
def settings_overrides() -> dict:
    return {"slurm_partition": "batch"}


@pytest.fixture
def token(settings) -> str:
    with session_factory(settings.resolved_database_url)() as session:
        record_pool(session, "slurm", "slurm", POOL)
        _, token = create_user(session, "alice")
        session.commit()
    return token


def test_a_job_asking_for_longer_than_the_partition_allows_is_refused_naming_the_field(api, token):
    answer = api.post("/v1/jobs", json=tiny_spec(**IN_POOL, **{"resources.max_runtime_hours": 2}), headers=auth(token))
    assert answer.status_code == 422, answer.text
    [error] = answer.json()["detail"]
    assert error["loc"][-2:] == ["resources", "max_runtime_hours"] and "at most 1 hours" in error["msg"]
    assert api.post("/v1/jobs", json=tiny_spec(**IN_POOL, **{"resources.max_runtime_hours": 1}), headers=auth(token)).status_code == 201
    assert api.get("/v1/pools", headers=auth(token)).json()[0]["max_minutes"] == 60


def test_a_job_without_a_limit_of_its_own_runs_within_the_partitions(settings, tmp_path):
    backend = SlurmBackend(session_factory(settings.resolved_database_url), settings, SlurmCommands())
    spec = JobSpec.model_validate(tiny_spec(**IN_POOL))
    batch = backend.batch_job("trainyard-1-1", spec, tmp_path, [1], max_minutes=60)
    assert batch.minutes == 60
    # Trainyard's supervisor stops it first, and says why: its limit is the partition's less the margin.
    assert float(batch.environment["TRAINYARD_MAX_RUNTIME_HOURS"]) * 60 == pytest.approx(60 - RUNTIME_MARGIN_MINUTES)
    # A partition without a limit: the service's own, as before.
    unlimited = backend.batch_job("trainyard-1-1", spec, tmp_path, [1], max_minutes=None)
    assert unlimited.minutes == settings.max_runtime_hours * 60 + RUNTIME_MARGIN_MINUTES
    assert float(unlimited.environment["TRAINYARD_MAX_RUNTIME_HOURS"]) == settings.max_runtime_hours


def test_a_pool_set_to_another_partition_is_unlisted_until_that_one_is_described(settings, api, token):
    # Seen: the scheduler restarted with TRAINYARD_SLURM_PARTITION naming a partition the cluster
    # hasn't; /v1/pools still showed the old one, and a submit checked against it was taken.
    settings = settings.model_copy(update={"slurm_partition": "gpus", "slurm_bin_dir": settings.data_dir / "no-slurm-here"})
    backend = SlurmBackend(session_factory(settings.resolved_database_url), settings, SlurmCommands(settings.slurm_bin_dir))
    backend.sync()  # sinfo fails: the description can't be renewed
    with session_factory(settings.resolved_database_url)() as session:
        assert all_pools(session) == []
    answer = api.post("/v1/jobs", json=tiny_spec(**IN_POOL), headers=auth(token))
    assert answer.status_code == 422 and "no pool named 'slurm'" in answer.text
