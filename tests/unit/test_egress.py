"""The control plane's ports closed to multi-node jobs (workers/egress.py): each worker process keeps
its own nftables table, so workers sharing a machine (every local stack names its hosts local-0,
local-1…) never remove each other's, and a killed worker's table goes when the next worker starts.

Run in a network namespace of the test's own (`unshare --net`): nftables tables belong to one, so the
test neither sees nor touches the tables of stacks other tests run at the same time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import IN_CI, REPO

SCENARIO = textwrap.dedent(
    """
    import subprocess, sys
    from workers.egress import close_control_plane, open_control_plane, table_name

    def tables():
        return subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True, check=True).stdout.split()

    def worker(then):  # another worker process: closes the ports, then `then`
        code = f"from workers.egress import *; assert close_control_plane([5432]); {then}"
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)

    living = worker("import sys; sys.stdin.read()")  # one that keeps running until told
    while table_name(living.pid) not in tables():
        pass
    killed = worker("")  # one that ends without removing its table (as kill -9 would leave it)
    killed.wait()
    assert table_name(killed.pid) in tables() and table_name(living.pid) in tables()  # it kept the living one's

    assert close_control_plane([5432, 6379]) == "ports 5432, 6379 closed to jobs (nftables)"
    assert table_name() in tables() and table_name(living.pid) in tables()  # its own, beside the living one's
    assert table_name(killed.pid) not in tables()  # the dead worker's, swept

    open_control_plane()  # this worker stops: its table goes, the other worker's stays
    assert table_name() not in tables() and table_name(living.pid) in tables()
    living.communicate(b"")
    print("ok")
    """
)


def test_each_worker_keeps_its_own_table_and_a_killed_workers_table_is_swept():
    if os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("unshare"):
        if IN_CI:
            pytest.fail("needs root, nft and unshare (make test installs nftables)")
        pytest.skip("needs root, nft and unshare")
    done = subprocess.run(["unshare", "--net", sys.executable, "-c", SCENARIO], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
