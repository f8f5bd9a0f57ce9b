"""Which attempts start from a warm interpreter, and how their inputs reach it (workers/warm_pool.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from api_schemas import JobSpec
from common.settings import Settings
from tests.helpers import job_spec
from workers import warm_pool
from workers.limits import Bounds
from workers.sandbox import SANDBOX_UID, HostSandbox
from workers.warm_pool import WarmInterpreter, WarmPool, place_inputs


def slot(tmp_path: Path) -> WarmInterpreter:
    warm = WarmInterpreter(tmp_path / "slot", process=None, limits=None, niced=False)
    warm.inputs.mkdir(parents=True)
    return warm


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "corpora").mkdir(parents=True)
    (root / "corpora" / "shared.txt").write_text("to be or not to be")
    (root / "corpora" / "shared.txt").chmod(0o644)
    (root / "uploads" / "7").mkdir(parents=True)
    (root / "uploads" / "7" / "private.txt").write_text("only the service reads this")
    (root / "uploads" / "7" / "private.txt").chmod(0o600)
    return root


def test_inputs_anyone_may_read_are_linked_and_private_ones_copied_for_the_job(tmp_path, data_root):
    checkpoint = tmp_path / "store" / "step-00000006"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "weights.bin").write_bytes(b"\0" * 64)
    (checkpoint / "model" / "weights.bin").chmod(0o644)
    warm = slot(tmp_path)

    assert place_inputs(warm, data_root, ["corpora/shared.txt", "uploads/7/private.txt", "never/uploaded.txt"], checkpoint, None)

    shared, private = warm.inputs / "data" / "corpora" / "shared.txt", warm.inputs / "data" / "uploads" / "7" / "private.txt"
    assert shared.stat().st_ino == (data_root / "corpora" / "shared.txt").stat().st_ino  # the file itself: no copy
    assert private.read_text() == "only the service reads this"
    assert private.stat().st_ino != (data_root / "uploads" / "7" / "private.txt").stat().st_ino
    if os.geteuid() == 0:
        assert private.stat().st_uid == SANDBOX_UID  # the job's user owns its copy; the original stays private
        assert (data_root / "uploads" / "7" / "private.txt").stat().st_uid == 0
    assert (warm.inputs / "resume" / "model" / "weights.bin").read_bytes() == b"\0" * 64
    assert not (warm.inputs / "data" / "never").exists()
    # Every directory on the way is one the job's user may enter, whatever the worker's umask.
    for directory in [warm.inputs / "data", warm.inputs / "data" / "uploads", warm.inputs / "resume" / "model"]:
        assert directory.stat().st_mode & 0o005 == 0o005


def test_inputs_too_large_to_copy_leave_the_attempt_to_a_cold_start(tmp_path, data_root, monkeypatch):
    monkeypatch.setattr(warm_pool, "WARM_COPY_LIMIT", 10)
    warm = slot(tmp_path)
    assert not place_inputs(warm, data_root, ["corpora/shared.txt", "uploads/7/private.txt"], None, None)
    assert list(warm.inputs.iterdir()) == []  # nothing placed


def script_spec(**fields) -> JobSpec:
    return JobSpec.model_validate({"name": "mine", "script": {"entrypoint": "train.py", "code": {"path": "project"}}, **fields})


@pytest.mark.parametrize(("spec", "warm"), [
    (job_spec(), True),
    (job_spec(**{"resources.processes_per_node": 2}), True),
    (script_spec(), False),  # its own program, in a clean environment
    (job_spec(**{"resources.nodes": 2}), False),  # a gang keeps the host's network
    (job_spec(**{"resources.device": "cuda"}), False),  # its GPUs are bound when its sandbox is made
    (job_spec(environment={"pip": ["tqdm==4.66.4"]}), False),  # another interpreter
])
def test_built_in_and_custom_loops_on_one_cpu_node_start_warm(tmp_path, spec, warm):
    pool = WarmPool(Settings(data_dir=tmp_path), HostSandbox(tool=None, unsafe=True, limits=None), size=1)
    assert pool._fits(spec, Bounds()) is warm
    # A memory limit needs a cgroup to apply it once the attempt is known.
    assert not pool._fits(job_spec(), Bounds(memory_bytes=2**30))
    assert not WarmPool(Settings(data_dir=tmp_path), HostSandbox(tool=None, unsafe=True, limits=None), size=0)._fits(spec, Bounds())


def test_fills_asked_at_once_start_only_what_the_pool_lacks(tmp_path, monkeypatch):
    pool = WarmPool(Settings(data_dir=tmp_path), HostSandbox(tool=None, unsafe=True, limits=None), size=2)
    started = []
    monkeypatch.setattr(pool, "_start", lambda: started.append(1) or WarmInterpreter(tmp_path / str(len(started)), None, None, False))
    pool.starting = 1  # another fill is starting one already
    pool._fill()
    assert len(started) == 1 and len(pool.ready) == 1 and pool.starting == 1
    pool.starting = 0  # that other start failed: one is lacking again
    pool._fill()
    pool._fill()  # full now: nothing more
    assert len(started) == 2 and len(pool.ready) == 2 and pool.starting == 0
