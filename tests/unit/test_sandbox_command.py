"""The sandbox's command line (workers/sandbox.py): what an attempt sees, as bwrap is told it."""

from __future__ import annotations

from pathlib import Path

from api_schemas import JobSpec
from tests.helpers import job_spec
from workers.sandbox import SANDBOX_UID, AttemptView, HostSandbox, sandbox_command


def binds(command: list[str], kind: str) -> list[tuple[str, str]]:
    return [(command[i + 1], command[i + 2]) for i, arg in enumerate(command) if arg == kind]


def test_a_single_node_attempt_gets_loopback_only_its_run_dir_writable_and_its_inputs_read_only(tmp_path: Path):
    run_dir, upload = tmp_path / "work" / "job-1" / "attempt-1", tmp_path / "data" / "uploads" / "3"
    view = AttemptView(run_dir, ((run_dir / "inputs" / "0-3", upload),), (tmp_path,), host_network=False)
    command = sandbox_command(["python", "train.py"], run_dir, view)
    assert {"--unshare-pid", "--unshare-net"} <= set(command)
    assert ("GLOO_SOCKET_IFNAME", "lo") in binds(command, "--setenv")
    assert binds(command, "--bind") == [(str(run_dir), str(run_dir))]  # the only writable place
    assert (str(run_dir / "inputs" / "0-3"), str(upload)) in binds(command, "--ro-bind")
    assert command.index(str(tmp_path)) < command.index(str(upload))  # the state is masked first, the input bound over it
    assert command[-2:] == ["python", "train.py"] and str(SANDBOX_UID) in command
    # Its own hosts file, naming IPv6 loopback: torch's store sees its clients as ::ffff:127.0.0.1,
    # and a lookup sent to DNS (unreachable here) made every rank log a c10d warning.
    [hosts] = [source for source, target in binds(command, "--ro-bind") if target == "/etc/hosts"]
    assert {"::1", "::ffff:127.0.0.1"} <= {line.split()[0] for line in Path(hosts).read_text().splitlines() if line.strip()}


def test_a_multi_node_attempt_keeps_the_host_network_and_a_gpu_attempt_sees_only_its_gpus(tmp_path: Path):
    view = AttemptView(tmp_path, (), (), host_network=True, gpus=(2, 3))
    command = sandbox_command(["python"], tmp_path, view)
    assert "--unshare-net" not in command
    assert "/etc/hosts" not in [target for _, target in binds(command, "--ro-bind")]  # the host's own, to find its peers
    nodes = {source for source, _ in binds(command, "--dev-bind-try")}
    assert {"/dev/nvidia2", "/dev/nvidia3", "/dev/nvidiactl"} <= nodes and "/dev/nvidia0" not in nodes
    assert ("CUDA_VISIBLE_DEVICES", "0,1") in binds(command, "--setenv")


def test_a_host_without_bwrap_refuses_user_code_unless_the_operator_opted_out():
    script = JobSpec.model_validate({"name": "mine", "script": {"entrypoint": "train.py", "code": {"path": "project"}}})
    missing = HostSandbox(tool=None, unsafe=False, limits=None)
    assert "no sandbox" in missing.refusal(script) and missing.refusal(job_spec()) is None
    with_packages = JobSpec.model_validate({**job_spec().model_dump(), "environment": {"pip": ["tinypkg"]}})
    assert "no sandbox" in missing.refusal(with_packages)  # packages are code too
    assert HostSandbox(tool=None, unsafe=True, limits=None).refusal(script) is None
    assert "unsafe-no-sandbox" in HostSandbox(tool="/usr/bin/bwrap", unsafe=True, limits=None).describe()


def test_a_python_installation_reached_through_a_link_starts_in_the_sandbox(tmp_path: Path, monkeypatch):
    # A clone whose `.venv` links to another's: the binds were of the real path only, and every
    # script job failed with "setpriv: failed to execute …/.venv/bin/python: No such file or directory".
    import shutil
    import subprocess
    import sys

    from workers import sandbox

    if shutil.which("bwrap") is None:
        return  # the sandbox's own tests (tests/e2e/test_sandbox.py) say bwrap is needed
    linked = tmp_path / "clone" / ".venv"
    linked.parent.mkdir()
    linked.symlink_to(sys.prefix)
    monkeypatch.setattr(sandbox.sys, "prefix", str(linked))
    assert sandbox.linked_prefix_binds(str(linked))[-3:] == ["--ro-bind", str(Path(sys.prefix).resolve()), str(linked)]
    python = linked / "bin" / Path(sys.executable).name
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = sandbox_command([str(python), "-c", "import sys; print(sys.prefix)"], run_dir, AttemptView(run_dir, (), (), host_network=False))
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(linked)
