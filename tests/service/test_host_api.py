"""The worker protocol's routes (service/api/routes/host_api.py) on both backends: a host's token
acts as that host only, on its own attempts only, and on no user route; a revoked one opens
nothing and its host's attempts are requeued; what a host sends again is stored once."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, func, select, update

from api_schemas import AttemptStatus, JobEventType, JobStatus
from api_schemas.host_api import MAX_LINES_PER_REPORT, MAX_POINTS_PER_REPORT, HostRegistration
from api_schemas.run_record import RunEnvironment
from service.api.main import create_app
from service.db.accounts import create_user, rotate_token
from service.db.host_tokens import issue_host_token, revoke_host_token
from service.db.jobs import create_job
from service.db.log_lines import log_lines_after
from service.db.metrics import metric_series
from service.db.models import Attempt, Job, JobEvent, LogLine, Metric, User, WorkerHost, utcnow
from service.db.session import READ_ONLY, session_factory
from service.scheduler import schedule_pass
from tests.helpers import auth, job_spec
from workers.host import check_shared_directories
from workers.host_client import HostClient, NotOurs, ServiceRefused
from workers.outbox import Outbox
from workers.supervisor import AttemptRunner

REGISTRATION = HostRegistration(device="cpu", slots=1, address="127.0.0.1")


@pytest.fixture
def sessions(settings):
    return session_factory(settings.resolved_database_url)


@pytest.fixture
def app(settings):
    return create_app(settings)


def host(app, sessions, name: str) -> HostClient:
    with sessions() as session:
        token = issue_host_token(session, name)
    client = HostClient("http://testserver", token, http=TestClient(app))
    client.token = token
    return client


def placed_on(sessions, settings, host_names: list[str]) -> dict[str, int]:
    """One job queued and placed on each of `host_names` (each a 1-slot host): {host: attempt id}."""
    with sessions() as session:
        user = create_user(session, "alice")[0]
        for _ in host_names:
            create_job(session, user, job_spec())
        placed = schedule_pass(session, settings)
    return {host_name: attempt_id for attempt_id, host_name in placed}


def test_a_host_token_acts_on_its_own_attempts_only_and_on_no_user_route(app, sessions, settings):
    a, b = host(app, sessions, "host-a"), host(app, sessions, "host-b")
    a.register(REGISTRATION), b.register(REGISTRATION)
    attempts = placed_on(sessions, settings, ["host-a", "host-b"])
    assert set(attempts) == {"host-a", "host-b"}

    # host-a can't claim, renew, report on or end host-b's attempt: a 404, as for one that doesn't exist.
    raw = TestClient(app)
    headers = auth(a.token)
    for path, body in (("claim", {"lease_owner": "a"}), ("lease", {"lease_owner": "a"}), ("report", {"lease_owner": "a", "logs": [[0, 0, "x"]]}),
                       ("report", {"lease_owner": "a", "renew_lease": True}), ("finish", {"lease_owner": "a", "outcome": "succeeded"})):
        answer = raw.post(f"/v1/host/attempts/{attempts['host-b']}/{path}", json=body, headers=headers)
        assert answer.status_code == 404, (path, answer.text)
    assert a.claim(attempts["host-b"], "a", "127.0.0.1:1") is None
    claimed = b.claim(attempts["host-b"], "b", "127.0.0.1:2")
    assert claimed is not None and claimed.job_id
    # Running now, and its lease owner known: still not host-a's (the hot routes' one-statement path checks the host too).
    for path, body in (("lease", {}), ("report", {}), ("report", {"renew_lease": True})):
        assert raw.post(f"/v1/host/attempts/{claimed.attempt_id}/{path}", json={"lease_owner": "b", **body}, headers=headers).status_code == 404
    assert b.renew(claimed).held
    with sessions() as session:
        assert session.get(Attempt, attempts["host-b"]).status == AttemptStatus.running
        assert log_lines_after(session, claimed.job_id, 0, 10) == []

    # No user route takes a host's token, and no host route a user's.
    assert raw.get("/v1/jobs", headers=headers).status_code == 401
    assert raw.get("/v1/workers", headers=headers).status_code == 401
    with sessions() as session:
        _, user_token = create_user(session, "admin", is_admin=True)
    assert raw.post("/v1/host/heartbeat", headers=auth(user_token)).status_code == 401
    assert raw.post("/v1/host/heartbeat").status_code == 401


def test_a_report_sent_again_is_stored_once_and_announces_no_step_twice(app, sessions, settings):
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    claimed = a.claim(placed_on(sessions, settings, ["host-a"])["host-a"], "a", "127.0.0.1:1")
    for resent in (False, True):  # its answer lost: the worker sends the same report again, saying so
        a.report(claimed, [(1, "train_loss", 2.5), (1, "grad_norm", float("nan"))], [(0, 0, "step 1"), (1, None, "launcher")], resent=resent)
    # Sent again with the next step, and a recomputed value: only what is new is announced.
    a.report(claimed, [(1, "train_loss", 2.4), (1, "grad_norm", float("nan")), (2, "train_loss", 2.3)], [], resent=True)
    with sessions() as session:
        events = session.scalars(select(JobEvent.data).where(JobEvent.job_id == claimed.job_id, JobEvent.type == JobEventType.metrics)).all()
        assert [(event["step"], event["values"]) for event in events] == [
            (1, {"train_loss": 2.5, "grad_norm": None}), (1, {"train_loss": 2.4}), (2, {"train_loss": 2.3})
        ]
    with sessions() as session:
        assert [(line.seq, line.rank, line.line) for line in log_lines_after(session, claimed.job_id, 0, 10)] == [(0, 0, "step 1"), (1, None, "launcher")]
        series = metric_series(session, claimed.job_id, ["train_loss", "grad_norm"], None, 100)
        assert series["train_loss"] == ([1, 2], [2.4, 2.3])
        assert series["grad_norm"] == ([1], [None])  # NaN travels as null, stored as NULL


def test_the_largest_report_the_protocol_allows_is_stored_whole(app, sessions, settings):
    # Our worker sends batches a fifth of this (so that its lease renewals come on time); the protocol
    # still takes a full one, from a host of another make, and stores every point and line of it.
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    claimed = a.claim(placed_on(sessions, settings, ["host-a"])["host-a"], "a", "127.0.0.1:1")
    names = 10
    points = [(step, f"m{k}", float(step + k)) for step in range(MAX_POINTS_PER_REPORT // names) for k in range(names)]
    lines = [(seq, 0, f"line {seq} " + "x" * 60) for seq in range(MAX_LINES_PER_REPORT)]
    assert a.report(claimed, points, lines, renew=True).lease.held
    with sessions() as session:
        count = lambda model: session.scalar(select(func.count()).select_from(model).where(model.job_id == claimed.job_id))  # noqa: E731
        assert (count(Metric), count(LogLine)) == (MAX_POINTS_PER_REPORT, MAX_LINES_PER_REPORT)
        assert session.scalar(select(Job.step).where(Job.id == claimed.job_id)) == MAX_POINTS_PER_REPORT // names - 1


def test_reports_are_paced_by_the_running_attempts_and_a_lease_renewal_is_the_hosts_heartbeat(sessions, settings):
    # Two running attempts, and an API that takes 4 reports a second: each host reports every 0.5 s.
    app = create_app(settings.model_copy(update={"api_reports_per_second": 4.0}))
    a, b = host(app, sessions, "host-a"), host(app, sessions, "host-b")
    a.register(REGISTRATION), b.register(REGISTRATION)
    attempts = placed_on(sessions, settings, ["host-a", "host-b"])
    claimed = a.claim(attempts["host-a"], "a", "127.0.0.1:1")
    assert b.claim(attempts["host-b"], "b", "127.0.0.1:1") is not None
    assert a.report(claimed, [(1, "train_loss", 2.5)], []).next_report_seconds == 0.5

    # A host renewing a lease sends no heartbeat of its own: the renewal moves its last heartbeat on.
    with sessions() as session:
        session.execute(update(WorkerHost).where(WorkerHost.name == "host-a").values(last_heartbeat=utcnow() - timedelta(minutes=5)))
        session.commit()
    assert a.renew(claimed).held and a.silent_for() < 60  # and the host knows it: no heartbeat due
    with sessions() as session:
        assert session.scalar(select(WorkerHost.last_heartbeat).where(WorkerHost.name == "host-a")) > utcnow() - timedelta(minutes=1)


def test_a_sync_with_something_to_report_renews_the_lease_in_the_report_one_request_not_two(app, sessions, settings):
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    claimed = a.claim(placed_on(sessions, settings, ["host-a"])["host-a"], "a", "127.0.0.1:1")
    sent: list[str] = []
    a.http.event_hooks["request"].append(lambda request: sent.append(request.url.path.rsplit("/", 1)[-1]))
    runner = AttemptRunner(settings, a, "host-a")

    def lease_expires_at():
        with sessions() as session:
            return session.get(Attempt, claimed.attempt_id).lease_expires_at

    outbox = Outbox(metrics=[(1, "train_loss", 2.5)])
    outbox.add_line(0, "step 1")
    before = lease_expires_at()
    synced = runner._sync(claimed, outbox)
    assert synced.lease.held and sent == ["report"] and outbox.empty()  # the report carried the renewal
    assert lease_expires_at() > before
    with sessions() as session:
        assert metric_series(session, claimed.job_id, ["train_loss"], None, 10)["train_loss"] == ([1], [2.5])
    # Nothing to report: the lease alone.
    assert runner._sync(claimed, Outbox()).lease.held and sent == ["report", "lease"]

    # A renewing report says what a lease request would: a cancel, then a lease that is no longer held.
    with sessions() as session:
        session.execute(update(Job).where(Job.id == claimed.job_id).values(cancel_requested=True))
        session.commit()
    assert a.report(claimed, [(2, "train_loss", 2.4)], [], renew=True).lease.cancel_requested
    lost = claimed.model_copy(update={"lease_owner": "a-before-a-restart"})
    assert a.report(lost, [], [(1, 0, "late")], renew=True).lease.held is False
    assert a.report(claimed, [], [(2, 0, "step 2")]).lease is None  # not asked: not renewed

    # A renewing report is its host's heartbeat; a plain one is not. A wrong token renews nothing.
    def heard_at():
        with sessions() as session:
            return session.scalar(select(WorkerHost.last_heartbeat).where(WorkerHost.name == "host-a"))
    quiet = heard_at()
    a.report(claimed, [], [(3, 0, "step 3")])
    assert heard_at() == quiet
    a.report(claimed, [], [(4, 0, "step 4")], renew=True)
    assert heard_at() > quiet
    body = {"lease_owner": "a", "renew_lease": True, "logs": [[5, 0, "step 5"]]}
    assert TestClient(app).post(f"/v1/host/attempts/{claimed.attempt_id}/report", json=body, headers=auth("not-a-token")).status_code == 401


def test_a_renewing_report_costs_the_database_less_than_the_lease_request_and_report_it_replaces(app, sessions, settings):
    # What a running host's heartbeat costs the API is mostly its round trips to the database: counted
    # here, as CPU timings on a shared machine can't tell 10 % apart.
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    claimed = a.claim(placed_on(sessions, settings, ["host-a"])["host-a"], "a", "127.0.0.1:1")

    def cost(send) -> tuple[int, int]:
        """(statements, commits of writing transactions) the API ran for `send()`. A read session's
        commit is left out: it writes nothing (it ends that way, not with ROLLBACK, for psycopg's
        prepared statements: service/db/session.py ReadSession)."""
        counted = {"statements": 0, "commits": 0}
        def statement(*_):
            counted["statements"] += 1
        def commit(connection):
            counted["commits"] += not connection.get_execution_options().get(READ_ONLY)
        event.listen(Engine, "before_cursor_execute", statement)
        event.listen(Engine, "commit", commit)
        try:
            send()
        finally:
            event.remove(Engine, "before_cursor_execute", statement)
            event.remove(Engine, "commit", commit)
        return counted["statements"], counted["commits"]

    points = [(1, "train_loss", 2.5), (1, "lr", 0.1)]
    lease = cost(lambda: a.renew(claimed))
    plain = cost(lambda: a.report(claimed, points, []))
    renewing = cost(lambda: a.report(claimed, [(2, name, value) for _, name, value in points], [], renew=True))
    assert renewing[0] < lease[0] + plain[0] and renewing[1] < lease[1] + plain[1], (renewing, lease, plain)
    # The renewal and the lease's read on top of a report, the heartbeat in the report's own commit
    # (PostgreSQL: 13 statements and 2 commits; before, 14 and 3, and 4 statements for a lease request,
    # now 3). On PostgreSQL a metrics batch's statements go in one pipeline, which these events don't see.
    assert renewing[0] <= plain[0] + 2 and renewing[1] == plain[1], (renewing, plain)


def test_a_host_can_register_only_checkpoints_of_its_own_job_that_are_in_the_store(app, sessions, settings):
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    claimed = a.claim(placed_on(sessions, settings, ["host-a"])["host-a"], "a", "127.0.0.1:1")
    raw = TestClient(app)
    for path in (f"jobs/{claimed.job_id + 1}/checkpoints/step-1", f"jobs/{claimed.job_id}/checkpoints/../../../etc",
                 f"jobs/{claimed.job_id}/checkpoints/never-written"):
        body = {"lease_owner": "a", "step": 1, "path": path, "sha256": "0" * 64, "size": 1}
        answer = raw.post(f"/v1/host/attempts/{claimed.attempt_id}/checkpoints", json=body, headers=auth(a.token))
        assert answer.status_code == 422 and "path" in answer.json()["detail"], answer.text


def test_keep_best_keeps_the_checkpoint_of_the_lowest_eval_loss_past_keep_last_and_the_listing_marks_it(app, sessions, settings):
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    with sessions() as session:
        user, token = create_user(session, "alice")
        job_id = create_job(session, user, job_spec(**{"checkpoint.keep_last": 1, "checkpoint.keep_best": True})).id
        [(attempt_id, _)] = schedule_pass(session, settings)
    claimed = a.claim(attempt_id, "a", "127.0.0.1:1")

    def save(step: int, eval_loss: float | None) -> str:
        """The step's metrics reported, then its checkpoint taken into the store and registered, as a worker does."""
        if eval_loss is not None:
            a.report(claimed, [(step, "eval_loss", eval_loss)], [])
        path = f"jobs/{job_id}/checkpoints/step-{step}"
        (settings.resolved_artifact_root / path).mkdir(parents=True)
        a.checkpoint_stored(claimed, step, path, "0" * 64, 1)
        return path

    listed = lambda: [(c["step"], c["eval_loss"], c["best"]) for c in TestClient(app).get(f"/v1/jobs/{job_id}/checkpoints", headers=auth(token)).json()]
    save(10, 2.0)
    save(20, 1.5)  # the best so far: the one of step 10 goes (keep_last 1)
    save(30, 1.7)
    assert listed() == [(20, 1.5, True), (30, 1.7, False)]
    save(40, None)  # a scheduled checkpoint between evaluations: the newest, and no eval_loss
    assert listed() == [(20, 1.5, True), (40, None, False)]
    save(50, 1.2)  # a better one: the old best is dropped like any other
    assert listed() == [(50, 1.2, True)]
    assert not (settings.resolved_artifact_root / f"jobs/{job_id}/checkpoints/step-20").exists()

    # Without keep_best no checkpoint is called the best: the lowest of those kept may be far from the job's.
    with sessions() as session:
        session.execute(update(Job).where(Job.id == job_id).values(spec={**session.get(Job, job_id).spec, "checkpoint": {"keep_last": 1}}))
        session.commit()
    save(60, 1.9)
    assert listed() == [(60, 1.9, False)]

    # Ranked by another metric, the highest best (a script that logs its accuracy: checkpoint.best_metric, best_mode).
    with sessions() as session:
        policy = {"keep_last": 1, "keep_best": True, "best_metric": "accuracy", "best_mode": "max"}
        session.execute(update(Job).where(Job.id == job_id).values(spec={**session.get(Job, job_id).spec, "checkpoint": policy}))
        session.commit()
    for step, accuracy in ((70, 0.8), (80, 0.6), (90, 0.7)):
        a.report(claimed, [(step, "accuracy", accuracy)], [])
        save(step, None)
    assert [(step, best) for step, _, best in listed()] == [(70, True), (90, False)]
    ranked = TestClient(app).get(f"/v1/jobs/{job_id}/checkpoints", headers=auth(token)).json()
    assert [(c["step"], c["best_value"]) for c in ranked] == [(70, 0.8), (90, 0.7)]  # what it ranks by, beside eval_loss


def test_a_revoked_host_token_opens_nothing_and_its_hosts_attempts_are_requeued(app, sessions, settings):
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    claimed = a.claim(placed_on(sessions, settings, ["host-a"])["host-a"], "a", "127.0.0.1:1")
    assert a.renew(claimed).held
    with sessions() as session:
        assert revoke_host_token(session, "host-a")
    assert not a.renew(claimed).held  # the worker stops it
    assert TestClient(app).post("/v1/host/heartbeat", headers=auth(a.token)).status_code == 401
    with sessions() as session:
        attempt = session.get(Attempt, claimed.attempt_id)
        assert (attempt.status, attempt.failure_reason) == (AttemptStatus.lost, "host host-a's token was revoked")  # not "stopped renewing"
        assert session.get(Job, claimed.job_id).status == JobStatus.queued  # to run elsewhere


def test_a_host_taken_out_of_the_pool_is_told_to_register_again(app, sessions, settings):
    a = host(app, sessions, "host-a")
    assert not a.heartbeat()  # never registered
    terms = a.register(REGISTRATION)
    assert a.heartbeat()
    # Idle, it heartbeats three times within the host timeout, less often than it would renew a lease.
    assert terms.idle_heartbeat_seconds == settings.host_timeout_seconds / 3 > terms.heartbeat_seconds


def test_a_registration_the_api_refuses_is_reported_refused_not_retried_for_ever(app, sessions, settings):
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    claimed = a.claim(placed_on(sessions, settings, ["host-a"])["host-a"], "a", "127.0.0.1:1")
    missing = f"jobs/{claimed.job_id}/checkpoints/never-written"
    with pytest.raises(ServiceRefused):  # a 422: sent again, refused again
        a.checkpoint_stored(claimed, 1, missing, "0" * 64, 1)
    runner = AttemptRunner(settings, a, "host-a")
    outbox = Outbox()
    outbox.checkpoints.taken.append(((settings.data_dir / "gone", 1, "step-1"), (missing, "0" * 64, 1)))
    assert runner._sync(claimed, outbox).lease.held  # the attempt goes on, its lease held
    assert runner._sync(claimed, outbox).lease.held and outbox.empty()  # nothing left that would hold its end back for ever
    with sessions() as session:
        [event] = session.scalars(select(JobEvent).where(JobEvent.job_id == claimed.job_id, JobEvent.type == JobEventType.checkpoint_refused))
        assert event.data["what"] == "step-1" and "the service refused to list it" in event.data["reason"]


def test_what_the_database_cant_keep_is_a_422_naming_the_field(app, sessions, settings):
    # Each was a 500 on PostgreSQL: integers past 32 bits, a metric name past its column, a status no worker ends in.
    a = host(app, sessions, "host-a")
    a.register(REGISTRATION)
    claimed = a.claim(placed_on(sessions, settings, ["host-a"])["host-a"], "a", "127.0.0.1:1")
    raw = TestClient(app)
    for path, body, field in (
        ("report", {"logs": [[2**40, 0, "x"]]}, ["body", "logs", 0, 0]),
        ("report", {"logs": [[1, 2**40, "x"]]}, ["body", "logs", 0, 1]),
        ("report", {"logs": [[1, 0, "x" * 5000]]}, ["body", "logs", 0, 2]),
        ("report", {"metrics": [[2**40, "loss", 1.0]]}, ["body", "metrics", 0, 0]),
        ("report", {"metrics": [[1, "x" * 65, 1.0]]}, ["body", "metrics", 0, 1]),
        ("finish", {"outcome": "running"}, ["body", "outcome"]),
        ("checkpoints", {"step": 2**40, "path": "x", "sha256": "0" * 64, "size": 1}, ["body", "step"]),
    ):
        answer = raw.post(f"/v1/host/attempts/{claimed.attempt_id}/{path}", json={"lease_owner": "a", **body}, headers=auth(a.token))
        assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == field, (path, answer.text)


def test_what_an_attempt_ran_with_is_its_part_of_the_jobs_run_record_and_only_its_host_reports_it(app, sessions, settings):
    a, b = host(app, sessions, "host-a"), host(app, sessions, "host-b")
    a.register(REGISTRATION), b.register(REGISTRATION)
    attempts = placed_on(sessions, settings, ["host-a"])
    claimed = a.claim(attempts["host-a"], "a", "127.0.0.1:1")
    environment = RunEnvironment(
        python="3.11.7", platform="Linux-x86_64", device="cpu: a test CPU", packages={"torch": "2.13.0"}, inputs={"corpus.txt": "ab" * 32},
    )
    other = TestClient(app).post(f"/v1/host/attempts/{claimed.attempt_id}/environment", headers=auth(b.token),
                                 json={"lease_owner": "a", "environment": environment.model_dump()})
    assert other.status_code == 404  # another host's attempt, as one that doesn't exist
    a.environment(claimed, environment)

    with sessions() as session:
        bob_token = create_user(session, "bob")[1]  # a user who can't see alice's job
        alice_token = rotate_token(session, session.scalar(select(User).where(User.name == "alice")))[0]
    users = TestClient(app)
    record = users.get(f"/v1/jobs/{claimed.job_id}/record", headers=auth(alice_token))
    assert record.status_code == 200, record.text
    [attempt] = record.json()["attempts"]
    assert attempt["host_name"] == "host-a" and attempt["environment"] == environment.model_dump()
    assert record.json()["spec"]["name"] == job_spec().name and record.json()["code_sha256"] is None
    assert users.get(f"/v1/jobs/{claimed.job_id}/record", headers=auth(bob_token)).status_code == 404


def test_a_host_that_says_it_shares_the_store_must_see_the_apis_own_or_it_does_not_start(app, sessions, settings, tmp_path):
    terms = host(app, sessions, "node-1").register(HostRegistration(device="cpu", slots=1, address="127.0.0.1"))
    check_shared_directories(settings, terms)  # the same directories as the API's: it starts
    # Its own default directories instead of where it mounts the API's: a checkpoint written there
    # could never be registered (refused for ever) and a job's data would not be found.
    for variable, field in (("TRAINYARD_ARTIFACT_ROOT", "artifact_root"), ("TRAINYARD_DATA_ROOT", "data_root")):
        elsewhere = settings.model_copy(update={field: tmp_path / field})
        with pytest.raises(ValueError, match=f"{tmp_path / field} is not the service's .* set {variable} to where this host mounts the API's"):
            check_shared_directories(elsewhere, terms)


def test_a_second_worker_under_a_live_hosts_name_is_refused_until_the_first_is_silent_or_its_token_replaced(app, sessions, settings):
    first = host(app, sessions, "node-1")
    first.register(REGISTRATION.model_copy(update={"instance": "first"}))
    second = HostClient("http://testserver", first.token, http=TestClient(app))  # another process, the same token
    with pytest.raises(NotOurs) as refused:
        second.register(REGISTRATION.model_copy(update={"instance": "second"}))
    assert refused.value.status == 409 and "another worker is up as host node-1" in str(refused.value)
    first.register(REGISTRATION.model_copy(update={"instance": "first"}))  # the first registering again (a restart of its own): fine
    # Dead (no heartbeat for host_timeout_seconds): its name is free.
    with sessions() as session:
        session.get(WorkerHost, "node-1").last_heartbeat = utcnow() - timedelta(seconds=settings.host_timeout_seconds + 1)
        session.commit()
    second.register(REGISTRATION.model_copy(update={"instance": "second"}))
    # An admin's new token for the name frees it at once: the old token's process can act no more.
    third = host(app, sessions, "node-1")
    third.register(REGISTRATION.model_copy(update={"instance": "third"}))
    with pytest.raises(NotOurs):
        second.heartbeat()
