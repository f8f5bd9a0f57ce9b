"""The sandbox every attempt's processes run in: they see the system and the Python environment read-only,
their own attempt directory writable, their own inputs readable, and nothing else of the host.

Why bubblewrap (`bwrap`, Debian's `bubblewrap`): it is the maintained sandbox Flatpak runs every app
in, a small program that builds exactly what is needed from its command line (PID, network, IPC and
mount namespaces, bind mounts, a private /proc and /dev) with no daemon, no image and no setuid bit of
its own. Docker or podman would add a daemon or an image per job; firejail is setuid with a record of
escalations; hand-written unshare/mount code is what bwrap already is, reviewed.

What one attempt gets (`sandbox_command`, a pure function of its `AttemptView`):
  - its own PID namespace (`/proc` shows only its processes) and IPC namespace;
  - user id 65534 (nobody) on the host, never the service's: a worker running as root starts bwrap
    privileged, which drops to that id (setpriv) before the job's command runs, with no capabilities
    and no_new_privs. A worker that is not root runs bwrap unprivileged: the job's id is 65534 inside
    its user namespace and the worker's own outside, so only the mount view keeps it from the
    service's files;
  - a new root holding read-only binds of the system (/usr, /etc, the lib links), the Python
    installation and the project's packages, with the service's state under them (the embedded data directory,
    the artifact, data, work, plugin and code roots) masked by empty tmpfs; a private /tmp and /dev/shm;
  - writable: its attempt directory only (checkpoints are written inside it; the worker takes them
    into the artifact store after verifying them); readable besides: its own inputs, each bound at
    its own path (dataset or upload, tokenizer, `hf` model directory, the `custom` plugin module, the
    checkpoint it resumes from); one the job's user id can't read is copied into the attempt first;
    the job's `environment.pip` virtualenv, if it has one (workers/environments.py);
  - single-node jobs: a network namespace with loopback only; multi-node jobs keep the host's network
    to meet their other nodes, the service's ports closed to them (workers/egress.py), and hold no
    credential either way (workers/launch.py);
  - its own GPUs' device nodes only, renumbered from 0 in CUDA_VISIBLE_DEVICES as CUDA numbers the
    GPUs it can open.
The job's environment (a script's `env`: LD_PRELOAD, PATH...) is applied by the sandbox's last step,
as the job's user (workers/enter_job_env.py): the shell, bwrap and setpriv before it run with none.
Memory and process limits are the attempt's cgroups (workers/limits.py).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from api_schemas import JobSpec
from common.settings import Settings
from workers import limits

SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup: owns nothing of the service's
MAX_PROCESSES = 4096  # processes and threads of one attempt (PyTorch starts a thread per core per rank)
MAX_OPEN_FILES = 65536
SYSTEM_DIRS = ("/usr", "/etc", "/opt")
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # links into /usr on merged-/usr systems
GPU_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# What an attempt imports of the project: the training loop, the script hooks and their types; never
# the service's code, its settings (common/), the server commands or the client.
PROJECT_PACKAGES = ("api_schemas", "workers")
INPUT_COPIES = "inputs"  # in the attempt directory: inputs the job's user id could not read where they are


@dataclass(frozen=True)
class HostSandbox:
    """What this worker host runs attempts in, as it tells the service and the operator."""

    tool: str | None  # the bwrap program, None if this host has none
    unsafe: bool  # the operator chose --unsafe-no-sandbox
    limits: str | None  # how memory and process limits are enforced (workers/limits.py), None: they can't be

    @classmethod
    def detect(cls, unsafe: bool) -> HostSandbox:
        return cls(shutil.which("bwrap"), unsafe, limits.available())

    @property
    def enabled(self) -> bool:
        return self.tool is not None and not self.unsafe

    def describe(self) -> str:
        if self.unsafe:
            return "none (--unsafe-no-sandbox: attempts run as the worker's own user, for a single-user machine)"
        if self.tool is None:
            return "unavailable: bubblewrap (bwrap) is not installed; script, custom and environment.pip jobs are refused"
        return f"bubblewrap, uid {SANDBOX_UID}, limits by {self.limits or 'rlimits (no writable cgroup)'}"

    def refusal(self, spec: JobSpec) -> str | None:
        """Why this host won't run `spec`'s code, if it won't: user code (a script, a custom loop, the
        packages of `environment.pip`) needs the sandbox, unless the operator opted out of it."""
        runs_code = spec.script is not None or spec.model.kind == "custom" or spec.environment is not None
        if self.enabled or self.unsafe or not runs_code:
            return None
        return f"this worker host has no sandbox ({self.describe()}); it runs only built-in jobs without environment.pip"


@dataclass(frozen=True)
class AttemptView:
    """What an attempt's processes see beyond the system: its directory (writable), its inputs
    (read-only, as (source on the host, path in the sandbox)), the service state to mask, whether
    it keeps the host's network, and its GPUs."""

    run_dir: Path
    inputs: tuple[tuple[Path, Path], ...]
    hidden: tuple[Path, ...]
    host_network: bool
    gpus: tuple[int, ...] = ()
    command_is_init: bool = False  # the command is the PID namespace's first process (workers/enter_job_env.py --init)
    interface: str | None = None  # with host_network: the one interface of the gang network it runs in (workers/gang_network.py)
    gang: tuple[str, ...] = ()  # in a gang network: its nodes' addresses, by node rank (named in its hosts file)


def job_inputs(spec: JobSpec, settings: Settings, data_root: Path, resume_from: Path | None) -> list[Path]:
    """The files and directories an attempt reads besides the system: those its spec names, under
    `data_root` (a script's code is copied into its directory already)."""
    inputs = [resume_from] if resume_from is not None else []
    if spec.script is not None:
        return inputs
    inputs += [data_root / relative for relative in spec.data_paths]
    if spec.model.kind == "custom":
        inputs.append(plugin_module(spec, settings))
    # Resolved as the training resolves them; one that doesn't exist fails there, saying so.
    return [path.resolve() for path in inputs if path.exists()]


def plugin_module(spec: JobSpec, settings: Settings) -> Path:
    """The file a `custom` job's entrypoint module is loaded from."""
    return settings.resolved_plugin_dir / f"{spec.model.entrypoint.partition(':')[0]}.py"


def service_state(settings: Settings) -> tuple[Path, ...]:
    """The service's own directories that lie inside the system view (the embedded data directory
    inside the project, say): each is masked there, so only what is bound in is visible."""
    state = dict.fromkeys(path.resolve() for path in (
        settings.data_dir, settings.resolved_artifact_root, settings.resolved_data_root, settings.resolved_work_root,
        settings.resolved_plugin_dir, settings.resolved_code_root, settings.resolved_environment_root,
    ))
    roots = _system_roots()
    return tuple(path for path in state if path.is_dir() and any(path.is_relative_to(root) for root in roots))


def prepare_attempt(run_dir: Path, inputs: Iterable[Path]) -> tuple[tuple[Path, Path], ...]:
    """Hand the attempt's directory to the sandbox's user, and return its inputs as binds: each at
    its own path, from a copy in the attempt's directory where that user couldn't read it (an
    upload, a checkpoint in the store: the service's files are its own only)."""
    binds = []
    for number, path in enumerate(inputs):
        source = path
        if not _readable_by_anyone(path):
            source = run_dir / INPUT_COPIES / f"{number}-{path.name}"
            if path.is_dir():
                shutil.copytree(path, source, dirs_exist_ok=True)
            else:
                source.parent.mkdir(exist_ok=True)
                shutil.copyfile(path, source)
        binds.append((source, path))
    if os.geteuid() == 0:
        _chown_tree(run_dir, SANDBOX_UID, SANDBOX_GID)
    return tuple(binds)


def sandbox_command(command: Sequence[str], cwd: Path, view: AttemptView, tool: str = "bwrap") -> list[str]:
    """`command` as it runs in the attempt's sandbox, starting in `cwd`.

    No --die-with-parent: the supervisor stops an attempt by SIGTERM to its process group (bwrap and
    all inside), and bwrap dies of it at once; with that flag its death would SIGKILL the training
    before it could save its checkpoint. The group's SIGKILL ends the PID namespace, and with it all."""
    args = [tool, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if view.command_is_init:
        args.append("--as-pid-1")  # not bwrap's own PID 1, which would wait for every process left, daemons too
    if not view.host_network:
        # Loopback only: the processes meet there, whatever interface the host told them to use.
        args += ["--unshare-net", "--setenv", "GLOO_SOCKET_IFNAME", "lo", "--setenv", "NCCL_SOCKET_IFNAME", "lo"]
    elif view.interface is not None:  # the network namespace it is started in: its gang meets on that interface
        args += ["--setenv", "GLOO_SOCKET_IFNAME", view.interface, "--setenv", "NCCL_SOCKET_IFNAME", view.interface]
    privileged = os.geteuid() == 0
    if privileged:
        args += ["--cap-add", "CAP_SETUID,CAP_SETGID"]  # only for setpriv below, which drops them
    else:
        args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm", "--perms", "1777", "--tmpfs", "/tmp"]
    args += _system_view()
    if not view.host_network:
        args += ["--ro-bind", str(_hosts_file(view.run_dir, [(a, "localhost") for a in ("::1", "::ffff:127.0.0.1")])), "/etc/hosts"]
    elif view.gang:  # its nodes' addresses have names: no lookup goes to a DNS it can't reach (each a 10 s wait)
        # TCPStore's dual-stack socket sees its clients as ::ffff:<address>: those named too.
        named = [(form, f"trainyard-node-{rank}") for rank, address in enumerate(view.gang) for form in (address, f"::ffff:{address}")]
        args += ["--ro-bind", str(_hosts_file(view.run_dir, named)), "/etc/hosts"]
    for path in view.hidden:
        args += ["--tmpfs", str(path)]
    for source, target in view.inputs:
        args += [*_parents(target), "--ro-bind", str(source), str(target)]
    args += [*_parents(view.run_dir), "--bind", str(view.run_dir), str(view.run_dir)]
    for node in [*GPU_CONTROL_NODES, *(f"/dev/nvidia{index}" for index in view.gpus)] if view.gpus else []:
        args += ["--dev-bind-try", node, node]
    if view.gpus:
        args += ["--setenv", "CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(len(view.gpus)))]
    args += ["--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--chdir", str(cwd)]
    if privileged:
        args += [
            shutil.which("setpriv") or "/usr/bin/setpriv", "--reuid", str(SANDBOX_UID), "--regid", str(SANDBOX_GID), "--clear-groups", "--inh-caps=-all",
            "--no-new-privs", "--",
        ]
    return args + list(command)


def _hosts_file(run_dir: Path, names: list[tuple[str, str]]) -> Path:
    """The system's hosts file with `names` (address, name) added where it has none, for a sandbox
    whose network reaches no DNS: its loopback only (torch's TCPStore listens on a dual-stack socket,
    so its clients come from ::ffff:127.0.0.1, which Debian's file doesn't name), or its gang. A
    lookup of an address the file doesn't name went to DNS, which it can't reach, and every rank
    logged `[c10d] The hostname of the client socket cannot be retrieved`, after a wait."""
    try:
        system = Path("/etc/hosts").read_text()
    except OSError:
        system = "127.0.0.1 localhost\n"
    known = {word for line in system.splitlines() for word in line.split("#")[0].split()[:1]}
    extra = [f"{address} {name}" for address, name in names if address not in known]
    path = run_dir / ".sandbox-hosts"
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(system.rstrip("\n") + "\n" + "".join(f"{line}\n" for line in extra))
    path.chmod(0o644)  # read by the job's user
    return path


def _system_view() -> list[str]:
    """Read-only binds of the system, the Python installation and the project."""
    args = []
    for link in SYSTEM_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    for path in _system_roots():
        args += [*_parents(path), "--ro-bind", str(path), str(path)]
    return args + linked_prefix_binds(sys.prefix)


def linked_prefix_binds(prefix: str) -> list[str]:
    """The Python installation at the path it was started by, where that is a link (a clone's
    `.venv` linked to another's): the binds above are of real paths, and every script job failed
    with `setpriv: failed to execute …/.venv/bin/python: No such file or directory`."""
    named, real = Path(os.path.abspath(prefix)), Path(os.path.realpath(prefix))
    return [] if named == real else [*_parents(named), "--ro-bind", str(real), str(named)]


def _parents(path: Path) -> list[str]:
    """`--dir` for each directory above `path`: bwrap would make the missing ones itself, but
    private to root (0700), which the job's user id could not pass through."""
    return [arg for parent in reversed(path.parents[:-1]) for arg in ("--dir", str(parent))]


def _system_roots() -> list[Path]:
    """The directories of the system view, outermost only. Of the project, its packages only, never
    its directory or one above it: that holds the embedded data directory beside them, and may be
    one only its owner can enter (a `mktemp -d` clone), which the job's user id could not pass."""
    # Not sys.path[0]: the worker's script directory, or with `python -m` its working directory,
    # which for `trainyard up` is the folder holding the data directory (in a private folder, its
    # read-only bind hid the attempt's own directory from the job's user, so the job could not read
    # its spec).
    python = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), *sys.path[1:]]
    python = [p for p in python if p and not PROJECT_ROOT.is_relative_to(Path(p).resolve())]
    project = [str(PROJECT_ROOT / package) for package in PROJECT_PACKAGES]
    paths = sorted({Path(p).resolve() for p in [*SYSTEM_DIRS, *python, *project] if p and os.path.isdir(p)}, key=lambda p: len(p.parts))
    outermost: list[Path] = []
    for path in paths:
        if not any(path.is_relative_to(parent) for parent in outermost):
            outermost.append(path)
    return outermost


def _readable_by_anyone(path: Path) -> bool:
    """Whether any user may read `path` (a directory: it and everything in it) where it is."""
    entries = [path] + (list(path.rglob("*")) if path.is_dir() else [])
    for entry in entries:
        mode = entry.lstat().st_mode
        if not mode & 0o004 or (entry.is_dir() and not mode & 0o001):
            return False
    return True


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid, follow_symlinks=False)
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)
