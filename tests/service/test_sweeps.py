"""Sweeps on SQLite and PostgreSQL: the controller (service/sweeps.py) with the scheduler's and the
workers' part played here, step by step, and the /v1/sweeps API."""

from __future__ import annotations

import itertools
import threading

import pytest
from sqlalchemy import select

from api_schemas import JobStatus, SweepStatus
from service.db.accounts import create_user
from service.db.checkpoints import list_checkpoints
from service.db.hosts import register_host
from service.db.models import Job
from service.db.session import session_factory
from service.sweeps import advance_sweep
from tests.helpers import auth, tiny_spec
from tests.sweep_helpers import EVAL_EVERY, MAX_STEPS, loss, run_sweep, sweep_spec

@pytest.fixture
def tokens(settings) -> dict[str, str]:
    with session_factory(settings.resolved_database_url)() as session:
        register_host(session, "host-a", "cpu", 4, {})
        session.commit()
        return {"alice": create_user(session, "alice")[1], "bob": create_user(session, "bob")[1]}


def submit(api, token: str, spec: dict) -> dict:
    response = api.post("/v1/sweeps", json=spec, headers=auth(token))
    assert response.status_code == 201, response.text
    return response.json()


def test_a_four_trial_grid_runs_every_trial_and_names_the_best(api, tokens, settings):
    sweep = submit(api, tokens["alice"], sweep_spec())
    assert sweep["status"] == "running" and sweep["trials"] == []

    ended, jobs = run_sweep(settings, sweep["id"])

    assert ended.status == SweepStatus.succeeded
    assert [job.trial_number for job in jobs] == [0, 1, 2, 3]
    assert all(job.status == JobStatus.succeeded for job in jobs)
    tried = sorted((job.spec["optimizer"]["lr"], job.spec["training"]["micro_batch_size"]) for job in jobs)
    assert tried == sorted(itertools.product([0.001, 0.003], [4, 8]))
    shown = api.get(f"/v1/sweeps/{sweep['id']}", headers=auth(tokens["alice"])).json()
    assert [trial["status"] for trial in shown["trials"]] == ["succeeded"] * 4
    best = shown["trials"][shown["best_trial"]]
    assert best["params"]["optimizer.lr"] == 0.003 and best["value"] == pytest.approx(loss(best["params"], MAX_STEPS))
    assert shown["best_spec"]["optimizer"]["lr"] == 0.003 and shown["best_spec"]["name"] == f"search-t{best['number']}"
    job = api.get(f"/v1/jobs/{best['job_id']}", headers=auth(tokens["alice"])).json()
    assert (job["sweep_id"], job["trial_number"]) == (sweep["id"], best["number"])


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_seeded_sweep_suggests_the_same_trials_twice(api, tokens, settings, sampler):
    space = {"optimizer.lr": {"log_uniform": [1e-4, 1e-2]}, "training.micro_batch_size": {"int_range": [2, 8], "step": 2}}
    # More trials than TPE's 10 random start-up ones, so that its model of the results picks some.
    spec = sweep_spec(search_space=space, sampler={"kind": sampler, "seed": 3}, budget={"max_trials": 12, "max_concurrent": 1})
    runs = []
    for _ in range(2):
        _, jobs = run_sweep(settings, submit(api, tokens["alice"], spec)["id"])
        runs.append([job.trial["params"] for job in jobs])
    assert len(runs[0]) == 12 and len({params["optimizer.lr"] for params in runs[0]}) == 12
    assert runs[0] == runs[1]
    other_seed = {**spec, "sampler": {"kind": sampler, "seed": 4}}
    _, jobs = run_sweep(settings, submit(api, tokens["alice"], other_seed)["id"])
    assert [job.trial["params"] for job in jobs] != runs[0]


def test_asha_prunes_the_trial_that_falls_behind_at_a_checkpoint_keeping_its_checkpoints(api, tokens, settings):
    spec = sweep_spec(
        search_space={"optimizer.lr": {"choice": [0.003, 0.002, 0.05]}},  # 0.05: a far worse loss
        sampler={"kind": "grid", "seed": 3},  # this seed tries 0.002, 0.003, then 0.05
        budget={"max_trials": 3, "max_concurrent": 1},
        pruner={"kind": "asha", "min_steps": EVAL_EVERY, "reduction_factor": 2},
    )
    ended, jobs = run_sweep(settings, submit(api, tokens["alice"], spec)["id"])

    assert ended.status == SweepStatus.succeeded
    by_lr = {job.trial["params"]["optimizer.lr"]: job for job in jobs}
    assert by_lr[0.05].trial_number == 2
    bad = by_lr[0.05]
    assert bad.status == JobStatus.pruned and bad.step < MAX_STEPS
    assert bad.failure_reason.startswith("pruned by the sweep's asha pruner at step 4: eval_loss")
    assert by_lr[0.003].status == JobStatus.succeeded
    with session_factory(settings.resolved_database_url)() as session:
        assert [checkpoint.step for checkpoint in list_checkpoints(session, bad.id)] == [4]
    shown = api.get(f"/v1/sweeps/{ended.id}", headers=auth(tokens["alice"])).json()
    assert shown["trials"][2]["status"] == "pruned" and shown["trials"][2]["reason"].startswith("pruned")


def test_schedulers_acting_on_one_sweep_at_once_add_each_trial_once(api, tokens, settings):
    """Four controllers at once (a scheduler restarted while the old one still ran, or two
    schedulers): the sweep's lock and its unique trial numbers leave exactly max_concurrent trials."""
    spec = sweep_spec(sampler={"kind": "random", "seed": 1}, budget={"max_trials": 8, "max_concurrent": 3})
    sweep_id = submit(api, tokens["alice"], spec)["id"]
    sessions = session_factory(settings.resolved_database_url)
    errors = []

    def controller():
        try:
            with sessions() as session:
                advance_sweep(session, sweep_id, settings)
        except Exception as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=controller) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with sessions() as session:
        numbers = list(session.scalars(select(Job.trial_number).where(Job.sweep_id == sweep_id).order_by(Job.trial_number)))
    assert numbers == [0, 1, 2]
    ended, jobs = run_sweep(settings, sweep_id)  # and a later controller goes on from there
    assert ended.status == SweepStatus.succeeded and [job.trial_number for job in jobs] == list(range(8))


@pytest.mark.parametrize(
    ("overrides", "loc"),
    [
        ({"base": tiny_spec(**{"optimizer.lr": -1})}, ["body", "base", "optimizer", "lr"]),
        ({"base": tiny_spec(**{"dataset.path": "missing.txt"})}, ["body", "base", "dataset", "path"]),
        ({"search_space": {"optimizer.lrr": {"choice": [0.1]}}}, ["body", "search_space", "optimizer.lrr"]),
        ({"search_space": {"training.micro_batch_size": {"int_range": [0, 4]}}}, ["body", "search_space", "training.micro_batch_size"]),
        ({"search_space": {"optimizer.lr": {"uniform": [0.1, 0.01]}}}, ["body", "search_space", "optimizer.lr"]),
    ],
)
def test_a_sweep_no_job_could_run_gets_422_naming_the_field(api, tokens, overrides, loc):
    response = api.post("/v1/sweeps", json=sweep_spec(**overrides), headers=auth(tokens["alice"]))
    assert response.status_code == 422, response.text
    assert [error["loc"][: len(loc)] for error in response.json()["detail"]][0] == loc


@pytest.mark.parametrize(
    ("space", "says"),
    [
        ({"search_space": {"optimizer.lr": {"log_uniform": [1e-4, 1e-2]}}}, "continuous"),
        ({"search_space": {"name": {"choice": ["a", "b"]}}}, "each trial is named"),
        # Found by a new user: every trial ran, none reported it, and the sweep "succeeded" with no best.
        ({"objective": {"metric": "val_loss"}}, "objective.metric: the built-in loop reports train_loss"),
    ],
)
def test_a_sweep_that_could_never_work_gets_422_saying_why(api, tokens, space, says):
    response = api.post("/v1/sweeps", json=sweep_spec(**space), headers=auth(tokens["alice"]))
    assert response.status_code == 422 and says in response.text, response.text


def test_another_users_sweep_is_404_and_a_cancel_ends_its_trials(api, tokens, settings):
    sweep_id = submit(api, tokens["alice"], sweep_spec())["id"]
    assert api.get(f"/v1/sweeps/{sweep_id}", headers=auth(tokens["bob"])).status_code == 404
    assert api.post(f"/v1/sweeps/{sweep_id}/cancel", headers=auth(tokens["bob"])).status_code == 404
    assert api.get("/v1/sweeps", headers=auth(tokens["bob"])).json()["items"] == []
    with session_factory(settings.resolved_database_url)() as session:
        advance_sweep(session, sweep_id, settings)  # two trials queued

    cancelled = api.post(f"/v1/sweeps/{sweep_id}/cancel", headers=auth(tokens["alice"])).json()

    assert cancelled["status"] == "cancelled"
    assert [trial["status"] for trial in cancelled["trials"]] == ["cancelled", "cancelled"]
    with session_factory(settings.resolved_database_url)() as session:
        advance_sweep(session, sweep_id, settings)  # a cancelled sweep gets no more trials
    listed = api.get("/v1/sweeps", headers=auth(tokens["alice"])).json()["items"]
    assert [(sweep["id"], len(sweep["trials"])) for sweep in listed] == [(sweep_id, 2)]
