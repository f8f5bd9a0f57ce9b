"""A throwaway Slurm cluster on this one machine, for the Slurm pool's tests and bench/slurm_start.py:
munge on its own socket, `slurmctld`, and two `slurmd` nodes (n1, n2, both at 127.0.0.1 on ports
of their own), every file under one temporary directory, stopped and removed after.

Two partitions share the nodes, as on a cluster with a preemptible tier: `batch` (the default,
where Trainyard submits) and `urgent`, whose jobs preempt batch's (preempt/partition_prio, REQUEUE:
the preempted job is signalled, given GraceTime, and, as Trainyard submits it --no-requeue,
ended rather than run again by Slurm).

    cluster = SlurmCluster.start_new()      # raises SlurmUnavailable saying why it can't
    subprocess.run(["sbatch", ...], env=cluster.env)
    url = cluster.start_rest()              # slurmrestd, JWT only, for the REST way in
    token = cluster.token()                 # a JWT for the current user, as `scontrol token` makes it
    cluster.stop()

Debian's packages (slurm-wlm, munge) are what `make test` installs; the daemons are started
directly (there is no systemd here) and run as the current user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from workers.supervisor import free_port

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
GRACE_SECONDS = 20  # a preempted batch job's time to checkpoint between SIGTERM and SIGKILL


class SlurmUnavailable(Exception):
    pass


def why_no_slurm() -> str | None:
    missing = [name for name in ("munged", "slurmctld", "slurmd", "sbatch", "slurmrestd") if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]
    return f"not installed: {', '.join(missing)} (Debian's slurm-wlm, slurmrestd and munge)" if missing else None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, directory: Path):
        self.directory = directory
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.controller_port, self.node_ports = free_port(), {name: free_port() for name in NODES}
        self.conf = directory / "slurm.conf"
        self.munge_socket = directory / "munge" / "munge.socket"
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    @classmethod
    def start_new(cls) -> SlurmCluster:
        if why := why_no_slurm():
            raise SlurmUnavailable(why)
        # Short and outside pytest's tmp dir: munge's socket path has a ~100-byte limit.
        cluster = cls(Path(tempfile.mkdtemp(prefix="trainyard-slurm-")))
        cluster.directory.chmod(0o755)  # slurmrestd, which refuses to run as root, reads slurm.conf as nobody
        try:
            cluster.start()
        except Exception:
            cluster.stop()
            raise
        return cluster

    def start(self) -> None:
        self._start_munge()
        self._write_conf()
        for sub in ("state", "log", *(f"spool/{name}" for name in NODES)):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self._spawn([_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for name in NODES:
            self._spawn([_binary("slurmd"), "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}")
        self._wait_until_idle()

    def _start_munge(self) -> None:
        munge = self.directory / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        command = [
            _binary("munged"), "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}", "--force",
        ]
        self._spawn(command, "munged")
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"munged did not start: {self._log('munged')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        d = self.directory
        (d / "jwt.key").write_bytes(os.urandom(32))  # slurmctld's key for the tokens slurmrestd passes on
        (d / "jwt.key").chmod(0o600)
        nodes = "\n".join(
            f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} RealMemory=2000 State=UNKNOWN"
            for name, port in self.node_ports.items()
        )
        self.conf.write_text(f"""\
ClusterName=trainyard-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.controller_port}
SlurmUser={self.user}
SlurmdUser={self.user}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmdParameters=config_overrides
AuthAltTypes=auth/jwt
AuthAltParameters=jwt_key={d}/jwt.key
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
KillWait=5
MinJobAge=300
InactiveLimit=0
{nodes}
PartitionName=batch Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_SECONDS}
PartitionName=urgent Nodes={','.join(NODES)} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
""")
        self.conf.chmod(0o644)  # slurmrestd reads it as nobody, whatever umask this process has (`trainyard up` sets 077)

    def _spawn(self, command: list[str], name: str) -> None:
        with open(self.directory / f"{name}.out", "ab") as out:
            self.processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True))

    def _log(self, name: str) -> str:
        for path in (self.directory / f"{name}.out", self.directory / "log" / f"{name}.log", self.directory / "munge" / f"{name}.log"):
            if path.exists():
                return path.read_text()[-2000:]
        return "(no log)"

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
            if all(states.get(name, "").startswith("idle") for name in NODES):
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"the nodes did not come up ({states or result.stderr.strip()}):\n{self._log('slurmctld')}")
            time.sleep(0.1)

    def start_rest(self) -> str:
        """slurmrestd on a free port, taking JWTs only (as a site exposes it), run as nobody (it
        refuses root); its URL once it answers."""
        port = free_port()
        command = [_binary("slurmrestd"), "-f", str(self.conf), "-a", "rest_auth/jwt", "-s", "openapi/v0.0.38", "-u", "nobody", f"127.0.0.1:{port}"]
        saved, self.env = self.env, {**self.env, "SLURM_JWT": "daemon"}  # its own calls to slurmctld by JWT: no munge as nobody
        try:
            self._spawn(command, "slurmrestd")
        finally:
            self.env = saved
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return f"http://127.0.0.1:{port}"
            except OSError:
                if time.monotonic() > deadline:
                    raise SlurmUnavailable(f"slurmrestd did not start: {self._log('slurmrestd')}") from None
                time.sleep(0.05)

    def token(self, lifespan_seconds: int = 3600) -> str:
        """A JWT for the current user, as `scontrol token` prints it (SLURM_JWT=…)."""
        return self.run("scontrol", "token", f"username={self.user}", f"lifespan={lifespan_seconds}").strip()

    def run(self, *command: str) -> str:
        """A Slurm command's output, against this cluster; raises on failure."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=True).stdout

    def stop(self) -> None:
        # Its jobs first: their steps (slurmstepd, srun) run in sessions of their own, so stopping the
        # daemons left a job still running behind, for good, after every run of the suite.
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.run("scancel", "--full", f"--user={os.getuid()}")
            deadline = time.monotonic() + 15
            while self.run("squeue", "--noheader").strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
