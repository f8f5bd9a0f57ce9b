"""The fetch cache of a host without the artifact store (workers/store_access.py): its trim removes
the files no attempt links, with their lock files, and never one being fetched or linked; a fetcher
that waited on a lock file the trim removed locks the path anew, so two never fetch one file at once."""

from __future__ import annotations

import fcntl
import os
import threading

from workers.store_access import StoreThroughApi, _locked


def test_the_trim_removes_unlinked_files_with_their_locks_and_leaves_the_rest(tmp_path):
    store = StoreThroughApi(service=None, scratch=tmp_path, cache_bytes=0)
    store.cache.mkdir(parents=True)
    for name in ("unused", "linked", "busy"):
        (store.cache / name).write_bytes(b"x" * 10)
        (store.cache / f"{name}.lock").touch()
    os.link(store.cache / "linked", tmp_path / "an-attempts-copy")
    with open(store.cache / "busy.lock") as held:  # being fetched or linked right now
        fcntl.flock(held, fcntl.LOCK_EX)
        store._trim_cache()
    assert sorted(path.name for path in store.cache.iterdir()) == ["busy", "busy.lock", "linked", "linked.lock"]


def test_a_fetcher_that_waited_on_a_removed_lock_file_locks_the_path_again(tmp_path):
    path = tmp_path / "file.lock"
    first = _locked(path)
    got = []
    waiter = threading.Thread(target=lambda: got.append(_locked(path)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waits for the first
    path.unlink()  # as the trim does, holding the lock
    first.close()
    waiter.join(5)
    [second] = got
    # It holds the file now at the path (made again), not the removed one: a third waits for it.
    assert os.fstat(second.fileno()).st_ino == os.stat(path).st_ino
    with open(path) as third:
        try:
            fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("locked twice")
        except BlockingIOError:
            pass
    second.close()
