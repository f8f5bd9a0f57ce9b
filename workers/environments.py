"""Per-job Python environments (`environment.pip`): a virtualenv built with uv over the worker's
own environment, cached on this host by what it holds, shared by the jobs that ask for the same.

Layering. The new virtualenv's site-packages holds the job's packages and one .pth file that adds
the worker's own site-packages after them (`site.addsitedir`, so the worker's own .pth files, its
editable install among them, still work). Python finds the job's packages first and everything else
(torch, accelerate, the project) in the worker's environment, which is never copied or reinstalled.
uv does not look through a .pth file (nor through `--system-site-packages` when the worker's Python
is a venv itself), so while it resolves, the new environment holds a stub `.dist-info` (metadata
only) for each of the worker's distributions: uv sees them as installed, keeps those that satisfy
the requirements and installs nothing for them. The stubs left are deleted after the install, so
the job reads the real metadata from the worker's environment. torch and accelerate are pinned to
the worker's versions (the training loop and the script hooks are written against them); any other
package a job asks for in another version shadows the worker's.

Safety. Wheels only (`--only-binary :all:`): a source distribution's build script would run here,
as the worker's account with its credentials, outside the sandbox; a wheel's install runs no code.
The environment is only ever run inside the attempt's sandbox, read-only.

Cache. An environment is keyed by the hash of (requirements, Python version, worker environment)
and lives in `<root>/<key>`, with two lock files (flock): `<key>.lock`, held shared by each
attempt using it and taken exclusive (without waiting) to delete it, so eviction never deletes
one in use; and `<key>.build.lock`, exclusive while it is built, so concurrent attempts wanting it
build it once (the others wait for that build; attempts wanting other environments go on). A
build happens in `<root>/.building/` and is renamed into place when complete, so a killed build
leaves nothing that is later used. `<key>.lock`'s mtime is when the environment was last used:
past `max_bytes`, the least recently used ones not in use are deleted.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The worker's own packages an environment never replaces: the training loop and the script hooks use them.
PINNED = ("torch", "accelerate")
STUB_INSTALLER = "trainyard-base-stub"  # the INSTALLER of a stub .dist-info
LAYER_PTH = "_trainyard_base.pth"
INFO_FILE = "trainyard-environment.json"  # in a built environment: what it holds, its size
ERROR_LINES = 12  # of uv's output, in a failure's reason

Log = Callable[[str], None]


class EnvironmentFailed(Exception):
    """The environment could not be built; the message names the requirement that failed."""


@dataclass
class Environment:
    """A built environment, held in use (its lock shared) until `release`."""

    path: Path
    key: str
    lock: IO

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        return site_packages_of(self.path)

    def release(self) -> None:
        self.lock.close()  # closing the file drops its flock


def site_packages_of(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def canonical_requirement(text: str) -> str:
    """`Six [b,a] >=1 , <2` and `six[a,b]<2,>=1` are one requirement: one spelling for the cache key."""
    requirement = Requirement(text)
    extras = f"[{','.join(sorted(canonicalize_name(e) for e in requirement.extras))}]" if requirement.extras else ""
    return f"{canonicalize_name(requirement.name)}{extras}{requirement.specifier}"


class EnvironmentCache:
    def __init__(
        self, root: Path, max_bytes: int, index_url: str | None = None, find_links: Sequence[str] = (), no_index: bool = False,
        base_site: Sequence[Path] | None = None,
    ):
        self.root, self.max_bytes = root, max_bytes
        self.index_args = (["--index-url", index_url] if index_url else []) + [arg for link in find_links for arg in ("--find-links", link)]
        self.index_args += ["--no-index"] if no_index else []
        # The worker's own environment: its site-packages directories, in sys.path's order.
        self.base_site = [Path(p) for p in (base_site or site.getsitepackages()) if os.path.isdir(p)]
        self._base_distributions: dict[str, metadata.Distribution] | None = None
        self._base_versions: list[str] | None = None

    # -- what an environment is --------------------------------------------------------------------

    @property
    def base_distributions(self) -> dict[str, metadata.Distribution]:
        """The worker's installed distributions by canonical name (the first one found, as Python would)."""
        if self._base_distributions is None:
            found: dict[str, metadata.Distribution] = {}
            for distribution in metadata.distributions(path=[str(p) for p in self.base_site]):
                found.setdefault(canonicalize_name(distribution.metadata["Name"]), distribution)
            self._base_distributions = found
        return self._base_distributions

    def key(self, requirements: Iterable[str]) -> str:
        """The cache key: what the environment is made of, hashed."""
        if self._base_versions is None:  # each version is a file read: once per worker
            self._base_versions = sorted(f"{name}=={d.version}" for name, d in self.base_distributions.items())
        made_of = {
            "pip": sorted(canonical_requirement(r) for r in requirements),
            "python": [sys.version, platform.machine(), os.path.realpath(sys.executable)],
            "base": [str(p) for p in self.base_site] + self._base_versions,
        }
        return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:32]

    # -- using one -----------------------------------------------------------------------------------

    def acquire(self, requirements: Sequence[str], log: Log) -> Environment:
        """The environment of `requirements`, built if this host has none, held in use until its
        `release`. Blocks while another attempt builds the same one. Raises EnvironmentFailed."""
        key = self.key(requirements)
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / key
        in_use = open(self.root / f"{key}.lock", "a")  # noqa: SIM115 (held for as long as the environment is used)
        built = False
        try:
            # Shared from here on: no eviction takes it (one under way finishes first).
            fcntl.flock(in_use, fcntl.LOCK_SH)
            if not path.is_dir():
                # The build lock is a file of its own: a builder must never wait for the attempts
                # using an environment, only for another builder of it, whose result it then finds.
                with open(self.root / f"{key}.build.lock", "a") as building:
                    fcntl.flock(building, fcntl.LOCK_EX)
                    if not path.is_dir():
                        self._build(key, requirements, log)
                        built = True
            os.utime(in_use.fileno())  # used now: the LRU order
            if not built:
                log(f"trainyard: environment {key[:12]} is cached on this host; reused")
            environment = Environment(path, key, in_use)
        except BaseException:
            in_use.close()
            raise
        if built:
            self.evict(log)
        return environment

    # -- building one --------------------------------------------------------------------------------

    def _build(self, key: str, requirements: Sequence[str], log: Log) -> None:
        """Build `key`'s environment in a scratch directory and rename it into place (we hold its build lock)."""
        started = time.monotonic()
        scratch = self.root / ".building"
        scratch.mkdir(exist_ok=True)
        for leftover in scratch.glob(f"{key}-*"):  # a killed build's; nobody else builds this key now
            shutil.rmtree(leftover, ignore_errors=True)
        building = scratch / f"{key}-{uuid.uuid4().hex[:8]}"
        log(f"trainyard: building environment {key[:12]} with uv: {' '.join(requirements)}")
        try:
            # --relocatable: its scripts find their Python relative to themselves, so the rename keeps them working.
            self._uv(["venv", "--relocatable", "--python", sys.executable, str(building)], requirements, log)
            self._layer_over_base(site_packages_of(building))
            constraints = building / "trainyard-constraints.txt"
            constraints.write_text("".join(f"{name}=={self.base_distributions[name].version}\n" for name in PINNED if name in self.base_distributions))
            self._uv(
                ["pip", "install", "--python", str(building / "bin" / "python"), "--only-binary", ":all:", "--no-cache",
                 *self.index_args, "--constraints", str(constraints), *requirements],
                requirements, log,
            )
            constraints.unlink()
            self._remove_stubs(site_packages_of(building))
            size = _readable_by_all(building)
            (building / INFO_FILE).write_text(json.dumps({"requirements": list(requirements), "size_bytes": size}))
            os.chmod(building / INFO_FILE, 0o644)
            os.rename(building, self.root / key)  # atomic: the environment is there whole, or not at all
        finally:
            shutil.rmtree(building, ignore_errors=True)
        log(f"trainyard: environment {key[:12]} built in {time.monotonic() - started:.1f} s ({size / 1e6:.1f} MB)")

    def _layer_over_base(self, site_packages: Path) -> None:
        """The .pth that puts the worker's environment after the job's packages, and the stubs uv resolves against."""
        adds = "; ".join(f"site.addsitedir({str(p)!r})" for p in self.base_site)
        (site_packages / LAYER_PTH).write_text(f"import site; {adds}\n")
        for name, distribution in self.base_distributions.items():
            stub = site_packages / f"{name.replace('-', '_')}-{distribution.version}.dist-info"
            stub.mkdir()
            (stub / "METADATA").write_text(distribution.read_text("METADATA") or f"Metadata-Version: 2.1\nName: {name}\nVersion: {distribution.version}\n")
            (stub / "INSTALLER").write_text(f"{STUB_INSTALLER}\n")
            # Its own files only: should uv replace this package, it removes the stub, never the worker's files.
            (stub / "RECORD").write_text("".join(f"{stub.name}/{file},,\n" for file in ("METADATA", "INSTALLER", "RECORD")))

    @staticmethod
    def _remove_stubs(site_packages: Path) -> None:
        for installer in site_packages.glob("*.dist-info/INSTALLER"):
            if installer.read_text().strip() == STUB_INSTALLER:
                shutil.rmtree(installer.parent)

    def _uv(self, args: list[str], requirements: Sequence[str], log: Log) -> None:
        """Run uv, each line of its output logged; EnvironmentFailed, naming the requirement, if it fails."""
        from uv import find_uv_bin  # the uv package's own binary

        env = {name: value for name, value in os.environ.items() if not name.startswith("TRAINYARD_")}
        env.update({"NO_COLOR": "1", "UV_PYTHON_DOWNLOADS": "never"})
        command = [find_uv_bin(), *args, "--no-config", "--no-progress"]
        tail: deque[str] = deque(maxlen=ERROR_LINES)
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=self.root, text=True) as uv:
            for line in uv.stdout:
                line = line.rstrip()
                log(line)
                tail.append(line)
        if uv.returncode != 0:
            raise EnvironmentFailed(failure_reason(requirements, list(tail)))

    # -- collecting old ones -------------------------------------------------------------------------

    def evict(self, log: Log | None = None) -> list[str]:
        """Delete the least recently used environments not in use until the rest fit in max_bytes;
        the keys deleted."""
        for leftover in (self.root / ".building").glob("deleting-*"):  # an eviction killed mid-way (or under way: harmless)
            shutil.rmtree(leftover, ignore_errors=True)
        built = []
        for path in self.root.iterdir():
            try:
                info = json.loads((path / INFO_FILE).read_text())
                built.append(((self.root / f"{path.name}.lock").stat().st_mtime, path.name, info["size_bytes"]))
            except (OSError, ValueError, KeyError):
                continue  # not an environment (a lock file, .building), or one being deleted
        total = sum(size for _, _, size in built)
        deleted = []
        for _, key, size in sorted(built):
            if total <= self.max_bytes:
                break
            with open(self.root / f"{key}.lock", "a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # in use (or being built): never taken from under a running job
                trash = self.root / ".building" / f"deleting-{key}-{uuid.uuid4().hex[:8]}"
                trash.parent.mkdir(exist_ok=True)
                try:
                    os.rename(self.root / key, trash)  # gone for every later look at once; the files go next
                except FileNotFoundError:
                    continue  # another worker process deleted it first
            shutil.rmtree(trash, ignore_errors=True)
            total -= size
            deleted.append(key)
            if log is not None:
                log(f"trainyard: environment {key[:12]} ({size / 1e6:.1f} MB) deleted, least recently used (cache over {self.max_bytes / 1e6:.0f} MB)")
        return deleted


def failure_reason(requirements: Sequence[str], uv_output: list[str]) -> str:
    """What failed, naming the requirements uv's error names (else uv's words must do)."""
    # From uv's first error line on: the lines before say what it was doing.
    first = next((i for i, line in enumerate(uv_output) if line.startswith(("error", "×"))), 0)
    error = "\n".join(uv_output[first:])
    named = [r for r in requirements if re.search(rf"(?<![\w.-]){re.escape(Requirement(r).name)}(?![\w-])", error, re.IGNORECASE)]
    which = ", ".join(named) if named else "the requirements"
    return f"environment.pip: could not install {which}:\n{error}"


def _readable_by_all(root: Path) -> int:
    """Let the sandbox's user read (and enter) everything in `root` (the worker's umask keeps its
    files to itself); returns the bytes it holds."""
    size = 0
    for directory, dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            path = os.path.join(directory, name)
            stat = os.lstat(path)
            size += stat.st_size
            if not os.path.islink(path):
                os.chmod(path, (stat.st_mode | 0o444 | (0o111 if stat.st_mode & 0o100 else 0)) & 0o7755)
    return size
