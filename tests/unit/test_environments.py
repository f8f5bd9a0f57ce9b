"""The per-job environment cache (workers/environments.py), with real uv installing real wheels
from a local find-links directory: layering over the worker's environment, the cache key, the
lock, atomic publishing and LRU eviction."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.wheels import make_wheel
from workers.environments import INFO_FILE, EnvironmentCache, EnvironmentFailed, canonical_requirement

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    directory = tmp_path / "wheels"
    make_wheel(directory, "tinypkg", "1.2", "MESSAGE = 'tiny 1.2'\n")
    make_wheel(directory, "tinypkg", "1.3", "MESSAGE = 'tiny 1.3'\n")
    make_wheel(directory, "needs_torch", "0.1", "import torch\nTORCH = torch.__file__\n", requires=("torch>=2",))
    return directory


def cache(tmp_path: Path, wheels: Path, max_bytes: int = 10**10) -> EnvironmentCache:
    return EnvironmentCache(tmp_path / "environments", max_bytes, find_links=[str(wheels)], no_index=True)


def run_in(environment, code: str) -> str:
    done = subprocess.run([environment.python, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_wheel_is_installed_over_the_workers_environment_whose_torch_is_used_not_reinstalled(tmp_path, wheels):
    lines = []
    environment = cache(tmp_path, wheels).acquire(["tinypkg==1.2", "needs_torch"], lines.append)
    try:
        out = run_in(environment, "import tinypkg, needs_torch, workers, importlib.metadata as m; print(tinypkg.MESSAGE, needs_torch.TORCH, m.version('torch'))")
        assert out == f"tiny 1.2 {torch.__file__} {torch.__version__}"  # the worker's torch, found through the layer
        installed = {line.split()[1] for line in lines if line.startswith(" + ")}
        assert installed == {"tinypkg==1.2", "needs-torch==0.1"}  # torch met by the worker's: nothing installed for it
        assert not list(environment.site_packages.glob("torch*"))  # no stub left either: metadata is read from the worker's
    finally:
        environment.release()


def test_a_requirement_the_worker_already_meets_installs_nothing(tmp_path, wheels):
    lines = []
    environment = cache(tmp_path, wheels).acquire(["accelerate>=1"], lines.append)
    environment.release()
    assert not [line for line in lines if line.startswith(" + ")]
    assert sorted(p.name for p in environment.site_packages.iterdir()) == ["_trainyard_base.pth"]


def test_torch_stays_at_the_workers_version_and_the_reason_names_the_package(tmp_path, wheels):
    with pytest.raises(EnvironmentFailed, match=r"could not install torch==1\.0:") as failed:
        cache(tmp_path, wheels).acquire(["torch==1.0", "tinypkg"], lambda line: None)
    assert "tinypkg" not in str(failed.value).splitlines()[0]  # met: only the one that failed is named


def test_a_missing_package_fails_naming_it_and_leaves_no_environment(tmp_path, wheels):
    environments = cache(tmp_path, wheels)
    with pytest.raises(EnvironmentFailed, match="could not install nosuchpkg==1") as failed:
        environments.acquire(["nosuchpkg==1", "tinypkg"], lambda line: None)
    assert "nosuchpkg was not found" in str(failed.value)  # uv's own words follow
    assert [p for p in environments.root.iterdir() if p.is_dir() and p.name != ".building"] == []
    assert list((environments.root / ".building").iterdir()) == []


def test_one_environment_per_set_of_requirements_however_spelt(tmp_path, wheels):
    environments = cache(tmp_path, wheels)
    assert canonical_requirement("Tiny_Pkg [b,a] >=1 , <2") == canonical_requirement("tiny-pkg[a,b]<2,>=1") == "tiny-pkg[a,b]<2,>=1"
    assert environments.key(["b", "a>=1"]) == environments.key(["A >= 1", "b"])
    assert environments.key(["a>=1"]) != environments.key(["a>=2"])
    # Another worker environment (here: an empty one) is another environment.
    assert EnvironmentCache(environments.root, 10**10, base_site=[tmp_path]).key(["a>=1"]) != environments.key(["a>=1"])


def test_the_second_job_reuses_the_environment_and_says_so(tmp_path, wheels):
    environments = cache(tmp_path, wheels)
    first, second = [], []
    environments.acquire(["tinypkg==1.3"], first.append).release()
    started = time.monotonic()
    environment = environments.acquire(["tinypkg==1.3"], second.append)
    took = time.monotonic() - started
    environment.release()
    assert any("building environment" in line for line in first)
    assert second == [f"trainyard: environment {environment.key[:12]} is cached on this host; reused"]
    assert took < 5  # no uv run at all (the figure itself: bench/environment.py)


def test_concurrent_attempts_build_one_environment_once_while_another_builds_meanwhile(tmp_path, wheels):
    environments = cache(tmp_path, wheels)
    key = environments.key(["tinypkg==1.2"])
    environments.root.mkdir(parents=True)
    # Another builder of that environment holds its build lock: both attempts wanting it wait for it...
    with open(environments.root / f"{key}.build.lock", "a") as builder:
        fcntl.flock(builder, fcntl.LOCK_EX)
        logs: list[list[str]] = [[], []]
        got = [None, None]

        def want(i: int) -> None:
            got[i] = environments.acquire(["tinypkg==1.2"], logs[i].append)

        waiting = [threading.Thread(target=want, args=(i,)) for i in range(2)]
        for thread in waiting:
            thread.start()
        # ...while an attempt wanting another environment builds it meanwhile.
        other = environments.acquire(["tinypkg==1.3"], lambda line: None)
        other.release()
        time.sleep(0.5)
        assert all(thread.is_alive() for thread in waiting) and got == [None, None]
    for thread in waiting:
        thread.join(60)
    # The first to get the lock built it; the other found it built, though the first holds it in use.
    builds = [line for log in logs for line in log if "building environment" in line]
    assert len(builds) == 1 and not any(thread.is_alive() for thread in waiting)
    assert got[0].path == got[1].path == environments.root / key
    for environment in got:
        assert run_in(environment, "import tinypkg; print(tinypkg.MESSAGE)") == "tiny 1.2"
        environment.release()


def test_a_killed_builds_leftovers_are_never_used_and_are_cleared(tmp_path, wheels):
    environments = cache(tmp_path, wheels)
    key = environments.key(["tinypkg==1.2"])
    half = environments.root / ".building" / f"{key}-deadbeef"
    (half / "lib").mkdir(parents=True)  # what a build killed before its rename leaves
    lines = []
    environments.acquire(["tinypkg==1.2"], lines.append).release()
    assert any("building environment" in line for line in lines)  # not taken for a built one
    assert not half.exists() and (environments.root / key / INFO_FILE).is_file()


def test_the_least_recently_used_environments_not_in_use_are_deleted_past_the_size_limit(tmp_path, wheels):
    environments = cache(tmp_path, wheels)
    versions = ["tinypkg==1.2", "tinypkg==1.3", "needs_torch", "tinypkg"]
    held = {}
    for age, requirement in enumerate(versions[:3]):
        environment = environments.acquire([requirement], lambda line: None)
        os.utime(environments.root / f"{environment.key}.lock", (1000 + age, 1000 + age))  # last used: oldest first
        held[requirement] = environment
    held.pop("tinypkg==1.3").release()
    held.pop("needs_torch").release()
    size = {r: json.loads((environments.root / environments.key([r]) / INFO_FILE).read_text())["size_bytes"] for r in versions[:3]}
    environments.max_bytes = size["tinypkg==1.2"] + size["needs_torch"] + size["tinypkg==1.3"]  # the fourth is as big as 1.3's
    # The fourth build goes over the limit: the oldest, tinypkg==1.2, is in use and stays; the next oldest goes.
    newest = environments.acquire([versions[3]], lambda line: None)
    kept = {path.name for path in environments.root.iterdir() if (path / INFO_FILE).is_file()}
    assert kept == {held["tinypkg==1.2"].key, environments.key(["needs_torch"]), newest.key}
    # Once it is no longer in use, a collection under a smaller limit takes it, the oldest.
    held["tinypkg==1.2"].release()
    newest.release()
    environments.max_bytes = size["needs_torch"] + size["tinypkg==1.3"]
    assert environments.evict() == [environments.key(["tinypkg==1.2"])]
