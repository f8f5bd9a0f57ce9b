"""The worker's side of the worker protocol (api_schemas/host_api.py): every word a host says to
the service goes over its HTTP API, with the host's own token. No database credential is on the host.

A call that can't get through (the API restarting, the network cut, a 5xx) raises ServiceUnreachable,
and the caller keeps what it was sending for its next round: the supervisor's outbox is the
buffer, so a host that can't reach the API for a while keeps training and catches up. An answer that
says the attempt is not this host's any more (its lease lost, the host's token revoked) comes back
as a lease not held, and the attempt stops.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import httpx

from api_schemas.host_api import (
    HOST_API_PREFIX, AttemptEnd, CheckpointSeal, CheckpointStored, ClaimedAttempt, ClaimRequest, DirectoryListing, EnvironmentReport,
    Finished, HostRegistration, HostTerms, Lease, LeaseRequest, OutputSeal, OutputStored, RefusedTransfer, Rendezvous, Report, Reported, Rollback,
    StoredItem, Transferred,
)
from api_schemas.run_record import RunEnvironment

LOST = Lease(held=False, cancel_requested=False)
# A report is one POST of up to 20,000 points or 5,000 lines: on a loaded API that takes a while.
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
# A seal hashes every byte of the item on the service's side: a large checkpoint takes a while.
SEAL_TIMEOUT = httpx.Timeout(600.0, connect=5.0)


class ServiceError(Exception):
    """The service did not do what was asked; which of the kinds below says what to do."""


class ServiceUnreachable(ServiceError):
    """The API did not answer, or answered with a server error: try again later."""


class NotOurs(ServiceError):
    """The API says this host may not act on that (a token revoked, an attempt of another host, a lease lost)."""

    def __init__(self, message: str, status: int, detail: str = ""):
        super().__init__(message)
        self.status, self.detail = status, detail or message


class ServiceRefused(ServiceError):
    """The API refused the request as malformed (a 4xx other than the above): a bug of this side's, or a
    host that doesn't share the artifact store it was told to. Sent again, it would be refused again."""


class HostClient:
    def __init__(self, api_url: str, token: str, http: httpx.Client | None = None):
        """`http`: another client to send through (the tests' in-process one, FastAPI's TestClient)."""
        self.http = http or httpx.Client(timeout=TIMEOUT)
        self.api_url = api_url.rstrip("/")
        self.http.base_url = self.api_url + HOST_API_PREFIX
        self.http.headers.update({"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        # When the service last heard this host: a heartbeat, or a lease renewal, which is its heartbeat too.
        self.heard_at = float("-inf")

    def close(self) -> None:
        self.http.close()

    def _post(self, path: str, body=None, **options) -> httpx.Response:
        return self._send("POST", path, content=None if body is None else body.model_dump_json(), **options)

    def _send(self, method: str, path: str, **options) -> httpx.Response:
        try:
            answer = self.http.request(method, path, **options)
        except httpx.HTTPError as exc:
            raise ServiceUnreachable(f"{path}: {exc}") from exc
        return self._check(path, answer)

    @staticmethod
    def _check(path: str, answer: httpx.Response) -> httpx.Response:
        if answer.status_code >= 500 or answer.status_code == 429:
            raise ServiceUnreachable(f"{path}: {answer.status_code} {answer.text[:200]}")
        if answer.status_code in (401, 403, 404, 409):
            raise NotOurs(f"{path}: {answer.status_code} {answer.text[:200]}", answer.status_code, _detail(answer))
        if answer.status_code >= 400:
            raise ServiceRefused(f"{path}: {answer.status_code} {answer.text[:500]}")
        return answer

    # -- the host ---------------------------------------------------------------------------------

    def register(self, registration: HostRegistration) -> HostTerms:
        terms = HostTerms.model_validate_json(self._post("/register", registration).content)
        self.heard_at = time.monotonic()
        return terms

    def heartbeat(self) -> bool:
        """False if the service no longer has this host registered (it should register again)."""
        try:
            self._post("/heartbeat")
        except NotOurs as exc:
            if exc.status == 404:
                return False
            raise
        self.heard_at = time.monotonic()
        return True

    def deregister(self) -> None:
        self._post("/deregister")

    def deregister_apart(self) -> None:
        """`deregister` on a connection of its own, from a signal handler: the request it interrupted
        holds this client's pool. One the API doesn't take (out of reach, say) is let be: the host
        then goes offline when its heartbeats stop."""
        try:
            httpx.post(f"{self.http.base_url}deregister", headers=self.http.headers, timeout=httpx.Timeout(5.0))
        except httpx.HTTPError:
            pass

    # -- an attempt -------------------------------------------------------------------------------

    def claim(self, attempt_id: int, lease_owner: str, rendezvous: str) -> ClaimedAttempt | None:
        """The attempt under our lease; None if it is not ours to run (a duplicate delivery, cancelled)."""
        try:
            answer = self._post(f"/attempts/{attempt_id}/claim", ClaimRequest(lease_owner=lease_owner, rendezvous=rendezvous))
        except NotOurs:
            return None
        return ClaimedAttempt.model_validate_json(answer.content)

    def renew(self, claimed: ClaimedAttempt) -> Lease:
        try:
            answer = self._post(f"/attempts/{claimed.attempt_id}/lease", LeaseRequest(lease_owner=claimed.lease_owner))
        except NotOurs:
            return LOST
        lease = Lease.model_validate_json(answer.content)
        if lease.held:
            self.heard_at = time.monotonic()
        return lease

    def silent_for(self) -> float:
        """Seconds since a heartbeat or a lease renewal (which the service counts as this host's heartbeat) was answered."""
        return time.monotonic() - self.heard_at

    def rendezvous(self, claimed: ClaimedAttempt) -> Rendezvous:
        try:
            answer = self._post(f"/attempts/{claimed.attempt_id}/rendezvous", LeaseRequest(lease_owner=claimed.lease_owner))
        except NotOurs:
            return Rendezvous(rendezvous=None, lease=LOST)
        return Rendezvous.model_validate_json(answer.content)

    def report(
        self, claimed: ClaimedAttempt, metrics: list[tuple[int, str, float]], logs: list[tuple[int, int | None, str]],
        refused: list[RefusedTransfer] = (), resent: bool = False, renew: bool = False,
    ) -> Reported:
        """`resent`: an earlier report's answer was lost, so some of this may be stored already. `renew`:
        the lease too (the answer's `lease`, as `renew` would answer). The answer says how soon to send
        the next (the API spreads many hosts' reports out)."""
        points = [(step, name, value if math.isfinite(value) else None) for step, name, value in metrics]
        body = Report(lease_owner=claimed.lease_owner, metrics=points, logs=logs, refused=list(refused), resent=resent, renew_lease=renew)
        reported = Reported.model_validate_json(self._post(f"/attempts/{claimed.attempt_id}/report", body).content)
        if reported.lease is not None and reported.lease.held:
            self.heard_at = time.monotonic()
        return reported

    def environment(self, claimed: ClaimedAttempt, environment: RunEnvironment) -> None:
        self._post(f"/attempts/{claimed.attempt_id}/environment", EnvironmentReport(lease_owner=claimed.lease_owner, environment=environment))

    def checkpoint_stored(self, claimed: ClaimedAttempt, step: int, path: str, sha256: str, size: int) -> None:
        body = CheckpointStored(lease_owner=claimed.lease_owner, step=step, path=path, sha256=sha256, size=size)
        self._post(f"/attempts/{claimed.attempt_id}/checkpoints", body)

    def output_stored(self, claimed: ClaimedAttempt, name: str, step: int | None, path: str, sha256: str, size: int, files: int) -> None:
        body = OutputStored(lease_owner=claimed.lease_owner, name=name, step=step, path=path, sha256=sha256, size=size, files=files)
        self._post(f"/attempts/{claimed.attempt_id}/outputs", body)

    # -- files, for a host without the artifact store's filesystem (workers/store_access.py) ------

    def received(self, claimed: ClaimedAttempt, upload_id: str, path: str) -> int:
        """How many bytes of an upload's file the service holds."""
        return Transferred.model_validate_json(self._send("GET", f"/attempts/{claimed.attempt_id}/uploads/{upload_id}/{path}").content).received

    def send_part(self, claimed: ClaimedAttempt, upload_id: str, path: str, offset: int, data: bytes) -> int:
        """Write `data` at `offset` of the upload's file; how many bytes it now holds."""
        answer = self._send(
            "PUT", f"/attempts/{claimed.attempt_id}/uploads/{upload_id}/{path}", params={"offset": offset}, content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        return Transferred.model_validate_json(answer.content).received

    def seal(self, claimed: ClaimedAttempt, upload_id: str, seal: CheckpointSeal | OutputSeal) -> StoredItem:
        """Have the service verify the upload and take it into the store. Raises ServiceRefused if it doesn't match its manifest."""
        kind = "checkpoint" if isinstance(seal, CheckpointSeal) else "output"
        answer = self._post(f"/attempts/{claimed.attempt_id}/uploads/{upload_id}/{kind}", seal, timeout=SEAL_TIMEOUT)
        return StoredItem.model_validate_json(answer.content)

    def listing(self, claimed: ClaimedAttempt, kind: str) -> DirectoryListing:
        """The files of what the attempt reads from the store: `resume` (its checkpoint) or `code`."""
        return DirectoryListing.model_validate_json(self._send("GET", f"/attempts/{claimed.attempt_id}/files/{kind}").content)

    def fetch_file(self, claimed: ClaimedAttempt, kind: str, path: str, into, offset: int) -> None:
        """Append the file's bytes from `offset` on to the open file `into`, as they arrive."""
        url = f"/attempts/{claimed.attempt_id}/files/{kind}/{path}"
        try:
            with self.http.stream("GET", url, headers={"Range": f"bytes={offset}-"} if offset else {}) as answer:
                if answer.status_code >= 400:
                    answer.read()
                    self._check(url, answer)
                if offset and answer.status_code != 206:
                    raise ServiceRefused(f"{url}: asked from byte {offset}, got {answer.status_code}")
                for block in answer.iter_bytes(1 << 20):
                    into.write(block)
        except httpx.HTTPError as exc:
            raise ServiceUnreachable(f"{url}: {exc}") from exc

    def finish(self, claimed: ClaimedAttempt, outcome, reason: str | None, retry: bool, rollback: Rollback | None = None) -> bool:
        """Record the end; False if it was too late (the lease lost, the token revoked)."""
        body = AttemptEnd(lease_owner=claimed.lease_owner, outcome=outcome, reason=reason, retry=retry, rollback=rollback)
        try:
            answer = self._post(f"/attempts/{claimed.attempt_id}/finish", body)
        except NotOurs:
            return False
        return Finished.model_validate_json(answer.content).ended


def read_token(value: str | None, file: Path | None) -> str | None:
    """The host token: given, or read from a file (kept out of the process's command line, where `ps` shows it)."""
    if value:
        return value.strip()
    if file is not None:
        return file.read_text().strip()
    return None


def _detail(answer: httpx.Response) -> str:
    """What the API said (FastAPI's `detail`), or the start of the body of a server that is not it."""
    try:
        detail = answer.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return detail if isinstance(detail, str) else answer.text[:200]
