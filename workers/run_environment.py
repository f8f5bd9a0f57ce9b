"""What an attempt ran with, as its worker tells the service at its start (api_schemas/run_record.py):
the digest of every input it gives the training, its interpreter's packages and its job
environment's, the device. A rerun's inputs are checked against the digests it was given here too."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import platform
import subprocess
from pathlib import Path

from api_schemas import JobSpec
from api_schemas.manifest import sha256_file
from api_schemas.run_record import RunEnvironment
from common.settings import Settings
from workers.sandbox import plugin_module

# sha256 of a file by (path, inode, size, mtime, ctime): a dataset of many GB is read once per worker,
# not per attempt. The ctime too: `cp -p`, `rsync -t` and `tar x` write new bytes under the old mtime,
# but no one can set a ctime.
_digests: dict[tuple[str, int, int, int, int], str] = {}


def digest(path: Path) -> str:
    """A file's sha256; a directory's covers its files' relative names and digests, in order."""
    if path.is_dir():
        summary = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            summary.update(f"{file.relative_to(path)}\0{digest(file)}\n".encode())
        return summary.hexdigest()
    status = path.stat()
    key = (str(path), status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
    if key not in _digests:
        _digests[key] = sha256_file(path)
    return _digests[key]


def input_digests(spec: JobSpec, settings: Settings, data_root: Path) -> dict[str, str]:
    """The digests of what the job's spec names for the training to read, by the names a run record
    gives them: its path under the data root (`data_root` on this host), `plugin:<module>` for a
    custom loop's code. One that doesn't exist is left out (the training fails on it, saying so)."""
    named = {relative: data_root / relative for relative in spec.data_paths}
    if spec.model is not None and spec.model.kind == "custom":
        named[f"plugin:{spec.model.entrypoint.partition(':')[0]}"] = plugin_module(spec, settings)
    return {name: digest(path) for name, path in named.items() if path.exists()}


def changed_inputs(expected: dict[str, str], inputs: dict[str, str]) -> str | None:
    """Why the inputs are not those a rerun expects (JobSpec.inputs_sha256), if they aren't."""
    for name, sha256 in sorted(expected.items()):
        if name not in inputs:
            return f"input {name} is gone (the job it reruns read one with sha256 {sha256[:12]}…)"
        if inputs[name] != sha256:
            return f"input {name} changed since the job it reruns: sha256 {inputs[name][:12]}…, it read {sha256[:12]}…"
    return None


def packages(paths: list[str] | None = None) -> dict[str, str]:
    """Each installed distribution's name (lower case) and version: this interpreter's, or those under `paths`."""
    return dict(_packages(None if paths is None else tuple(paths)))


@functools.lru_cache(maxsize=64)
def _packages(paths: tuple[str, ...] | None) -> tuple[tuple[str, str], ...]:
    # Read once per worker and environment (a hundred-odd metadata files): neither changes under a running worker.
    found = importlib.metadata.distributions() if paths is None else importlib.metadata.distributions(path=list(paths))
    return tuple(sorted((dist.metadata["Name"].lower(), dist.version) for dist in found if dist.metadata["Name"]))


def device_model(spec: JobSpec, device_ids: list[int] | None) -> str:
    if spec.resources.device == "cuda":
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", ",".join(map(str, device_ids or []))]
        try:
            names = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.split("\n")
        except (OSError, subprocess.TimeoutExpired):
            names = []
        return "cuda: " + (", ".join(name.strip() for name in names if name.strip()) or "unknown model")
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return f"cpu: {names[0] if names else platform.processor() or 'unknown model'}"


def run_environment(
    spec: JobSpec, inputs: dict[str, str], device_ids: list[int] | None, site_packages: Path | None, cpu_threads: int | None = None,
) -> RunEnvironment:
    return RunEnvironment(
        python=platform.python_version(), platform=platform.platform(), device=device_model(spec, device_ids)[:300], cpu_threads=cpu_threads,
        packages=packages(), environment_packages=packages([str(site_packages)]) if site_packages else {}, inputs=inputs,
    )
