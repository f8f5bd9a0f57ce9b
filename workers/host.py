"""A worker host: registers its devices, heartbeats, and runs attempts sent to its Celery queue."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from urllib.parse import urlsplit

from celery.signals import worker_shutting_down

from api_schemas.host_api import HostRegistration, HostTerms
from common.artifacts import MARK_FILE, directory_mark
from common.queue import RUN_ATTEMPT_TASK, declare_host_queue, host_queue, make_celery
from common.settings import Settings
from workers.host_client import HostClient, NotOurs, ServiceError, ServiceRefused, ServiceUnreachable, read_token
from workers.sandbox import HostSandbox
from workers.limits import SlotShare
from workers.supervisor import AttemptRunner, heartbeat_pause
from workers import gang_network
from workers.egress import close_control_plane, open_control_plane
from workers.warm_pool import WarmPool

log = logging.getLogger("trainyard.worker")


def parse_devices(devices: str) -> tuple[str, int, dict]:
    """`cpu:4` → 4 CPU process slots; `cuda:all` or `cuda:0,1` → those GPUs, described via torch.cuda."""
    kind, _, which = devices.partition(":")
    if kind == "cpu":
        if not which.isdigit() or int(which) < 1:
            raise ValueError(f"--devices {devices!r}: expected cpu:N with N >= 1")
        return "cpu", int(which), {}
    if kind == "cuda":
        if which not in ("", "all") and not all(i.isdigit() for i in which.split(",")):
            raise ValueError(f"--devices {devices!r}: expected cuda:all or GPU indices, cuda:0,1,…")
        import torch  # only GPU hosts pay for importing torch here

        if not torch.cuda.is_available():
            raise ValueError("--devices cuda: no CUDA device is visible on this host")
        indices = range(torch.cuda.device_count()) if which in ("", "all") else [int(i) for i in which.split(",")]
        if missing := [i for i in indices if i >= torch.cuda.device_count()]:
            raise ValueError(f"--devices {devices!r}: no GPU {missing[0]} here (this host has {torch.cuda.device_count()})")
        gpus = [
            {"index": i, "name": torch.cuda.get_device_name(i), "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in indices
        ]
        return "cuda", len(gpus), {"gpus": gpus}
    raise ValueError(f"--devices {devices!r}: expected cpu:N, cuda:all or cuda:0,1,…")


def run_worker(settings: Settings, host_name: str, devices: str, address: str, unsafe_no_sandbox: bool = False) -> None:
    """`address`: where the other hosts of a multi-node job reach this one. `unsafe_no_sandbox`:
    the operator's choice to run attempts unsandboxed (workers/sandbox.py). The host speaks to the
    service only through its API (settings.api_url), with its own token; raises ValueError if it has none."""
    device, slots, info = parse_devices(devices)
    token = read_token(settings.host_token, settings.host_token_file)
    if not token:
        raise ValueError("no host token: give TRAINYARD_HOST_TOKEN or TRAINYARD_HOST_TOKEN_FILE (an admin makes one: trainyard host token NAME)")
    service = HostClient(settings.api_url, token)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request (a report every heartbeat) drowns the worker's own
    sandbox = HostSandbox.detect(unsafe_no_sandbox)
    info["sandbox"] = sandbox.describe()
    # A gang's attempts in networks of their own, where this host can make them (workers/gang_network.py).
    if sandbox.enabled and gang_network.available() is None:
        gang_network.remove_orphans()
        info["gang_network"] = True
    # The embedded broker is a file of `trainyard up`'s data directory (beside its admin token): a host
    # anywhere else would make a broker of its own there that no scheduler sends to.
    if settings.broker_url is None and not (settings.data_dir / "token").exists():
        raise ValueError(
            f"no broker: TRAINYARD_BROKER_URL is not set and {settings.data_dir.resolve()} is no `trainyard up` data directory "
            "with an embedded one: a host of a production service needs the service's Redis in TRAINYARD_BROKER_URL"
        )
    app = make_celery(settings)
    declare_host_queue(app, host_name)  # before the scheduler can see the host and send to it
    registration = HostRegistration(device=device, slots=slots, info=info, address=address, instance=uuid.uuid4().hex, name=host_name)
    warm: WarmPool | None = None

    # Stopped while it starts, the host leaves the pool, as Celery's worker has it do once up
    # (shutting_down, below; it takes SIGTERM and SIGINT over then). Else its name stays taken: jobs
    # are placed on it, and a worker started again under it is refused (409) until the host times out.
    # It ends the process itself: a SystemExit raised where the signal lands inside a weakref
    # callback is swallowed, and Celery then started a host already deregistered, whose heartbeat
    # (404) registered it again as it left.
    stop = threading.Event()

    def stopped_while_starting(signum: int, _frame) -> None:
        stop.set()
        service.deregister_apart()
        if warm is not None:
            warm.close()
        open_control_plane()
        logging.shutdown()
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopped_while_starting)
    terms = register(service, registration)
    if settings.shared_artifact_store:
        try:
            check_shared_directories(settings, terms)
        except ValueError:
            # Registered already (the marks to check come with the terms): it leaves, else it is taken
            # for up, jobs are placed on it, and the worker started again is refused (409) till it times out.
            service.deregister_apart()
            raise
    settings = follow_terms(settings, terms)
    # A gang keeps the host's network: only a root worker can close the service's ports to its jobs' user.
    ports = [*terms.control_plane_ports, api_port(settings.api_url)]
    said = []
    if terms.attempt_subnet:
        said.append(f"a multi-node job's attempts: a network of their own in {terms.attempt_subnet}, reaching their gang only")
    # Still, for a gang whose other hosts can't make such networks (it keeps the hosts' network then).
    if sandbox.enabled and os.geteuid() == 0 and (closed := close_control_plane(ports)):
        said.append(f"a multi-node job on the host's network: {closed}")
    if said:
        info["sandbox"] += "; " + "; ".join(said)
        registration.info["sandbox"] = info["sandbox"]
        register(service, registration)  # again, with that said, for GET /v1/workers
    (log.info if sandbox.enabled else log.warning)("host %s sandbox: %s", host_name, info["sandbox"])
    log.info("host %s registered with %s × %s at %s", host_name, slots, device, settings.api_url)

    # Idle, a host says it is alive less often than it renews leases (the service says how often):
    # 1,000 idle hosts' heartbeats are most of what such a fleet asks of the API.
    idle_heartbeat = terms.idle_heartbeat_seconds or settings.heartbeat_seconds

    def heartbeat() -> None:
        wait = settings.heartbeat_seconds  # (a random first wait made a short-lived stack's worker beat as it left)
        while not stop.wait(wait):
            runner.ended_attempts.sweep()
            wait = heartbeat_pause(settings.heartbeat_seconds)  # also after a heartbeat that failed: tried again, not at once
            if (due_in := idle_heartbeat - service.silent_for()) > 0:
                wait = min(wait, due_in)
                continue  # heard lately: a heartbeat, or an attempt's lease renewal, which the service takes for one
            if stop.is_set():  # leaving meanwhile (the sweep above can take a while): deregistered, not beating
                break
            try:
                if not service.heartbeat() and not stop.is_set():  # taken out of the pool meanwhile (e.g. the service's database restored)
                    service.register(registration)
            except NotOurs as exc:
                if exc.status == 401:  # revoked, or replaced by a new one: the host may not act any more
                    log.error("the service refused this host's token (revoked, or replaced by `trainyard host token %s`): "
                              "stopping; start the worker again with its new token", host_name)
                    os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown: the attempts, lost already, stop
                    return
                log.warning("heartbeat refused (%s); retrying", exc)
            except ServiceError as exc:
                log.warning("heartbeat failed (%s); retrying", exc)

    warm = WarmPool(settings, sandbox, settings.warm_interpreters)
    warm.fill()
    # Each slot's share of the host's cores and memory: a CPU process's threads, and what an attempt is bounded by.
    share = SlotShare.of_host(slots, settings.memory_gb_per_slot)
    runner = AttemptRunner(settings, service, host_name, address, sandbox, warm, share.cores if device == "cpu" else None, share)
    heartbeats = threading.Thread(target=heartbeat, name="heartbeat", daemon=True)  # also sweeps ended attempts' directories
    heartbeats.start()

    @app.task(name=RUN_ATTEMPT_TASK)
    def run_attempt(attempt_id: int) -> None:
        runner.run(attempt_id)

    # On SIGTERM Celery stops taking tasks and waits for the running ones. Leave the pool first,
    # so requeued jobs are placed on other hosts, then make the running attempts stop soon, at a
    # checkpoint, so they resume elsewhere with no step lost.
    def shutting_down(**_) -> None:
        stop.set()
        # A heartbeat on its way as the host leaves: answered 404 once it has left, and taken for a
        # host the service forgot, it registered the leaving host again (jobs were placed on it).
        heartbeats.join(timeout=settings.heartbeat_seconds)
        try:
            service.deregister()
        except NotOurs:  # its token revoked (said already, in its stop's reason): the service took it out itself
            pass
        except ServiceError as exc:  # out of reach, say: no traceback, it is no bug
            log.warning("could not deregister %s (%s); its heartbeat stops, so it goes offline anyway", host_name, exc)
        runner.preempt_all()
        warm.close()

    worker_shutting_down.connect(shutting_down, weak=False)

    # Supervising is waiting on subprocesses and the API, so threads suffice: one per slot,
    # since the scheduler never places more attempts on a host than it has slots. Prefetch 1: a
    # host holds no more messages than it has free threads (a duplicate that waits is a no-op).
    # No remote control: a job that reached the broker could otherwise shut down every host with
    # one broadcast (Celery's `shutdown`), and nothing of Trainyard's uses it.
    app.conf.worker_enable_remote_control = False
    app.worker_main(
        [
            "worker", "--queues", host_queue(host_name), "--pool", "threads", "--concurrency", str(slots),
            "--prefetch-multiplier", "1",
            "--hostname", f"{host_name}@trainyard", "--without-gossip", "--without-mingle", "--loglevel", "INFO",
        ]
    )
    stop.set()
    warm.close()
    open_control_plane()
    service.close()


def register(service: HostClient, registration: HostRegistration) -> HostTerms:
    """Join the pool, waiting for the API as long as it takes to answer (it may start after us);
    raises ValueError if it refuses the token or the name, or if no Trainyard API is at the URL."""
    pause = 0.2
    while True:
        try:
            return service.register(registration)
        except NotOurs as exc:
            if exc.status == 401:
                raise ValueError(f"the service at {service.api_url} refused this host's token (revoked, or replaced by a new one)") from exc
            if exc.status == 404:  # a path of another server (a URL with a path nginx doesn't route, another port's service)
                raise ValueError(f"no Trainyard API at {service.api_url} ({exc}): check TRAINYARD_API_URL") from exc
            if exc.status != 409:
                raise ValueError(f"the service refused this host: {exc.detail}") from exc
            # Another process is up under this name, or was until it died: its name is free once it is silent long enough.
            log.warning("cannot register yet: %s; retrying in %.1f s", exc, pause)
        except ServiceRefused as exc:
            raise ValueError(f"the service refused this host's registration: {exc}") from exc
        except ServiceUnreachable as exc:
            log.warning("cannot register yet at %s (%s); retrying in %.1f s", service.api_url, exc, pause)
        time.sleep(pause)
        pause = min(pause * 2, 5.0)


def check_shared_directories(settings: Settings, terms: HostTerms) -> None:
    """A host that shares the artifact store and the data root with the API must see the API's own
    (their mark files, common/artifacts.py): else its checkpoints would land where the API never
    looks, to be refused for ever, and its jobs fail reading data the API found. Raises ValueError."""
    for what, root, variable, mark in (
        ("artifact store", settings.resolved_artifact_root, "TRAINYARD_ARTIFACT_ROOT", terms.artifact_mark),
        ("data root", settings.resolved_data_root, "TRAINYARD_DATA_ROOT", terms.data_mark),
    ):
        if mark is not None and directory_mark(root) != mark:
            raise ValueError(
                f"{root} is not the service's {what} (its {MARK_FILE} is missing or another service's): set {variable} to "
                f"where this host mounts the API's, or TRAINYARD_SHARED_ARTIFACT_STORE=false if it doesn't mount it "
                "(checkpoints and data then go through the API)"
            )


def follow_terms(settings: Settings, terms: HostTerms) -> Settings:
    """The worker's settings with the service's timing and limits in place of its own."""
    return settings.model_copy(update=terms.model_dump(exclude={"control_plane_ports"}))


def api_port(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)
