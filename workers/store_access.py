"""How a worker host reaches the artifact store: on its own filesystem (`SharedStore`: checkpoints
and outputs moved in, then registered), or through the API (`StoreThroughApi`, for a host that
doesn't mount it: TRAINYARD_SHARED_ARTIFACT_STORE=false).

Through the API, every file is sent in parts, each written where the service says its copy ends,
so a cut connection or an API restart costs at most the part in flight; the service hashes every
byte against the item's manifest before it takes the item in. What an attempt reads from the
service (the checkpoint it resumes from, its data, a script's code) is fetched file by file the same
way (Range), each checked against the listing's sha256, into a cache of this host's named by that
sha256, and linked from there into a directory of the attempt's own that goes when it ends: the
next attempt of the job (a retry, a resume after preemption) fetches none of its data again. Files no
attempt links are removed, least recently used first, past the cache's size (TRAINYARD_FETCH_CACHE_GB).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import shutil
import time
import uuid
from pathlib import Path, PurePosixPath

from api_schemas import JobSpec
from api_schemas.host_api import MAX_UPLOAD_PART_BYTES, CheckpointSeal, ClaimedAttempt, OutputSeal
from api_schemas.manifest import MANIFEST_FILE, CorruptCheckpoint, checkpoint_name, sha256_file, write_manifest
from common.artifacts import ArtifactStore
from workers.host_client import HostClient, ServiceRefused, ServiceUnreachable

log = logging.getLogger(__name__)

RETRY_SECONDS = (1, 2, 4, 8, 15, 30)  # the pauses between tries while the API is out of reach, the last repeated
GIVE_UP_SECONDS = 30 * 60  # an item that could not be moved for this long is refused (an event of the job), not retried for ever


class SharedStore:
    """The store's directory is on this host, at the API's path: items are moved or copied in."""

    fetches = False  # what an attempt reads is read where it is: prepare() has nothing to do

    def __init__(self, root: Path, data_root: Path, reader_gid: int | None = None):
        self.store, self.data = ArtifactStore(root, reader_gid), data_root

    def prepare(self, claimed: ClaimedAttempt) -> None:
        """Nothing to fetch: the resume checkpoint, the code and the data are read where they are."""

    def data_root(self, claimed: ClaimedAttempt) -> Path:
        return self.data

    def resume_directory(self, claimed: ClaimedAttempt) -> Path | None:
        return self.store.path(claimed.resume_checkpoint_path) if claimed.resume_checkpoint_path else None

    def checkpoint(self, claimed: ClaimedAttempt, source: Path, step: int, folder: str | None) -> tuple[str, str, int]:
        return self.store.ingest_checkpoint(source, claimed.job_id, step, folder)

    def output(self, claimed: ClaimedAttempt, folder: Path, name: str, step: int | None) -> tuple[str, str, int, int]:
        """`folder`: the worker's own copy of the output (workers/job_paths.py copy_out), holding it as `name`."""
        return self.store.hand_over_output(folder, claimed.job_id, step)

    def release(self, claimed: ClaimedAttempt) -> None:
        pass


class StoreThroughApi:
    """The store as the API serves it to a host that doesn't mount it."""

    fetches = True

    def __init__(self, service: HostClient, scratch: Path, cache_bytes: int = 20 * 2**30):
        self.service = service
        self.scratch = scratch  # on this host: what attempts fetched, and outputs made ready to send
        self.cache, self.cache_bytes = scratch / "by-sha256", cache_bytes

    def _fetched(self, claimed: ClaimedAttempt) -> Path:
        return self.scratch / f"attempt-{claimed.attempt_id}"

    def prepare(self, claimed: ClaimedAttempt) -> None:
        """Fetch what the attempt reads from the service onto this host: the checkpoint it resumes from,
        the data its spec names, its script's code (then `claimed.code_path`, or `code_refused` saying why not)."""
        if (resume := self.resume_directory(claimed)) is not None:
            self._fetch(claimed, "resume", resume)
        if JobSpec.from_stored(claimed.spec).data_paths:
            self._fetch(claimed, "data", self.data_root(claimed))
        if claimed.spec.get("script") is not None:
            try:
                claimed.code_path = str(self._fetch(claimed, "code", self._fetched(claimed) / "code"))
            except (ServiceRefused, CorruptCheckpoint) as exc:
                claimed.code_path, claimed.code_refused = None, f"cannot fetch its code from the service: {exc}"

    def data_root(self, claimed: ClaimedAttempt) -> Path:
        """The attempt's data inputs, at their paths under the service's data root. Fetched for each
        attempt (not kept between attempts on this host)."""
        return self._fetched(claimed) / "data"

    def resume_directory(self, claimed: ClaimedAttempt) -> Path | None:
        """Under the name it has in the store: a script parses its step from it (`…/step_1200`)."""
        if not claimed.resume_checkpoint_path:
            return None
        return self._fetched(claimed) / "resume" / PurePosixPath(claimed.resume_checkpoint_path).name

    def checkpoint(self, claimed: ClaimedAttempt, source: Path, step: int, folder: str | None) -> tuple[str, str, int]:
        """Send the checkpoint (its manifest, as the training wrote it, among its files) and have it sealed."""
        if not (source / MANIFEST_FILE).is_file():
            raise CorruptCheckpoint(f"{source}: no manifest")
        stored = self._send(claimed, source, CheckpointSeal(lease_owner=claimed.lease_owner, step=step, folder=folder or checkpoint_name(step)))
        return stored.path, stored.sha256, stored.size

    def output(self, claimed: ClaimedAttempt, folder: Path, name: str, step: int | None) -> tuple[str, str, int, int]:
        """`folder`: the worker's own copy of the output, holding it as `name`: a manifest of its
        files written beside it (as the store would), sent, sealed."""
        write_manifest(folder, step)
        stored = self._send(claimed, folder, OutputSeal(lease_owner=claimed.lease_owner, name=name, step=step))
        return stored.path, stored.sha256, stored.size, stored.files

    def release(self, claimed: ClaimedAttempt) -> None:
        shutil.rmtree(self._fetched(claimed), ignore_errors=True)
        self._trim_cache()

    # -- moving files --------------------------------------------------------------------------

    def _send(self, claimed: ClaimedAttempt, directory: Path, seal: CheckpointSeal | OutputSeal):
        """Every file of `directory` to a new upload, each from where the service's copy ends, then
        the seal; tried again while the API is out of reach. A seal refused means the files don't
        match their manifest (changed while sent, or corrupt): CorruptCheckpoint, not retried."""
        upload_id = uuid.uuid4().hex
        files = [path for path in sorted(directory.rglob("*")) if path.is_file() and not path.is_symlink()]

        def send_all():
            for path in files:
                self._send_file(claimed, upload_id, path, path.relative_to(directory).as_posix())
            return self.service.seal(claimed, upload_id, seal)

        try:
            return _retrying(send_all, f"job {claimed.job_id}: sending {directory.name}")
        except ServiceRefused as exc:
            raise CorruptCheckpoint(f"{directory.name}: the service refused it: {exc}") from exc

    def _send_file(self, claimed: ClaimedAttempt, upload_id: str, path: Path, relative: str) -> None:
        size = path.stat().st_size
        received = self.service.received(claimed, upload_id, relative)  # 0, or where a cut left it
        if size == 0:
            self.service.send_part(claimed, upload_id, relative, 0, b"")  # an empty file is made by sending nothing
        with open(path, "rb") as file:
            while received < size:
                file.seek(received)
                received = self.service.send_part(claimed, upload_id, relative, received, file.read(MAX_UPLOAD_PART_BYTES))

    def _fetch(self, claimed: ClaimedAttempt, kind: str, into: Path) -> Path:
        """The files of `kind` into `into`, each from the cache or fetched into it first."""
        def fetch_all():
            listing = self.service.listing(claimed, kind)
            for relative, expected in listing.files.items():
                target = into / relative
                if not target.resolve().is_relative_to(into.resolve()):
                    raise CorruptCheckpoint(f"the listing names {relative!r}, outside the directory")
                target.parent.mkdir(parents=True, exist_ok=True)
                self._link_cached(claimed, kind, relative, expected, target)
            return into

        return _retrying(fetch_all, f"job {claimed.job_id}: fetching its {kind}")

    def _link_cached(self, claimed: ClaimedAttempt, kind: str, relative: str, expected, target: Path) -> None:
        """Link the cache's copy of a listed file at `target`, fetched first if it has none: verified
        against the listing before it is named by its sha256; a file half fetched is continued from
        its end. One copy on the host however many attempts read it (the sandbox binds it read-only)."""
        self.cache.mkdir(parents=True, exist_ok=True)
        # Attempts starting at once on this host often read the same file (two jobs on one dataset):
        # they take turns, the first fetches it, the others find it cached; and a file is linked
        # while its lock is held, so the cache's trim (which takes the lock) never removes it between.
        with _locked(self.cache / f"{expected.sha256}.lock"):
            cached = self._fetched_into_cache(claimed, kind, relative, expected)
            target.unlink(missing_ok=True)
            os.link(cached, target)
            os.utime(cached)  # used now: the last to be removed

    def _fetched_into_cache(self, claimed: ClaimedAttempt, kind: str, relative: str, expected) -> Path:
        """The cache's copy, fetched if it has none (its lock held)."""
        cached = self.cache / expected.sha256
        if cached.is_file() and cached.stat().st_size == expected.size:
            return cached
        partial = self.cache / f"{expected.sha256}.part"
        have = partial.stat().st_size if partial.is_file() else 0
        if have > expected.size:
            partial.unlink()
            have = 0
        with open(partial, "ab") as file:  # made, if empty
            if have < expected.size:
                self.service.fetch_file(claimed, kind, relative, file, have)
        if partial.stat().st_size != expected.size or sha256_file(partial) != expected.sha256:
            partial.unlink()
            raise CorruptCheckpoint(f"{kind} file {relative} does not match the service's listing")
        partial.rename(cached)
        return cached

    def _trim_cache(self) -> None:
        """Past the cache's size, remove the files no attempt links now, least recently used first,
        with their lock files (one being fetched or linked, its lock held, is left for next time)."""
        if not self.cache.is_dir():
            return
        files = [(path, path.stat()) for path in self.cache.iterdir() if not path.name.endswith((".part", ".lock"))]
        total = sum(status.st_size for _, status in files)
        for path, status in sorted(files, key=lambda item: item[1].st_mtime):
            if total <= self.cache_bytes:
                return
            if status.st_nlink != 1:  # linked into an attempt's directory
                continue
            lock_path = path.with_name(f"{path.name}.lock")
            with open(lock_path, "a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                if path.stat().st_nlink == 1:  # still: linked by none while we waited
                    path.unlink()
                    lock_path.unlink()  # a fetcher waiting on this one opens the path again (_locked)
                    total -= status.st_size


def _locked(path: Path):
    """`path` opened and exclusively locked (made if missing), as a context manager. A lock file
    removed by the cache's trim while this waited for it is opened again: locking the removed one
    would exclude no one who opens the path after."""
    while True:
        lock = open(path, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        except FileNotFoundError:
            pass
        lock.close()


def _retrying(work, what: str):
    """`work()` until it gets through: tried again after a pause while the API is out of reach (a cut
    mid-file goes on from where the service's copy ends), for up to GIVE_UP_SECONDS."""
    deadline = time.monotonic() + GIVE_UP_SECONDS
    for attempt in itertools.count():
        try:
            return work()
        except ServiceUnreachable as exc:
            if time.monotonic() > deadline:
                raise CorruptCheckpoint(f"{what}: the service was out of reach for {GIVE_UP_SECONDS} s ({exc})") from exc
            pause = RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)]
            log.warning("%s: %s; trying again in %s s", what, exc, pause)
            time.sleep(pause)

