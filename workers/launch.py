"""What an attempt's training processes are started with: where they run, their command line and
their environment. Functions of the job spec, the attempt's paths, the rendezvous and the node;
the supervisor (workers/supervisor.py) starts and watches the processes.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from api_schemas import JobSpec
from api_schemas.worker_protocol import CHECKPOINT_DIR_ENV, EVENTS_FILE_ENV, RESUME_FROM_ENV

# In an attempt's directory: the job spec the training reads, and what it reports (metrics,
# checkpoints) as JSON lines (api_schemas/worker_protocol.py).
SPEC_FILE_NAME = "spec.json"
EVENTS_FILE_NAME = "events.jsonl"

# What a script job's processes inherit from the worker's environment: nothing else, so no service
# credential (database or broker URL, tokens) reaches user code.
SCRIPT_INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
SCRIPT_SITE = Path(__file__).resolve().parent / "script_site"  # its sitecustomize.py installs workers/script_hooks.py

ENTER_JOB_ENV = Path(__file__).resolve().parent / "enter_job_env.py"
JOB_ENV_FILE_NAME = "job-env.json"  # in the attempt's directory until enter_job_env.py has read it

# The service's own settings, credentials among them (TRAINYARD_DATABASE_URL, _BROKER_URL) and where
# its state lives: no training process needs them (it reports through files).
SERVICE_SETTINGS_PREFIX = "TRAINYARD_"


def attempt_dir(work_root: Path, job_id: int, number: int, node_rank: int | None = None) -> Path:
    """Where an attempt runs: its events file, checkpoints and a script's copy of its code.
    `node_rank` only for a multi-node job, whose nodes share the attempt's number."""
    node = "" if node_rank is None else f"-node-{node_rank}"
    return work_root / f"job-{job_id}" / f"attempt-{number}{node}"


def working_dir(spec: JobSpec, run_dir: Path) -> Path:
    """Where the processes start: a script job in its own copy of its code (what it writes there
    stays with this attempt), any other in the attempt's directory."""
    return run_dir / "code" if spec.script is not None else run_dir


def launch_command(
    spec: JobSpec, run_dir: Path, data_root: Path, resume_from: Path | None, rendezvous: str, node_rank: int = 0,
    plugin_dir: Path | None = None, resume_step: int | None = None, python: str = sys.executable, cpu_threads: int | None = None,
    skip_steps: int = 0,
) -> list[str]:
    """`accelerate launch -m workers.training …` with the job's process counts and precision, for
    node `node_rank` of the job; `rendezvous` is host:port of node 0, where the processes meet.
    A `script` job runs `accelerate launch <entrypoint> <args>` instead (in its code directory),
    resuming with its `resume_args`' placeholders filled in (the checkpoint at `resume_step`).
    `python`: the interpreter the launcher and the processes run (the job's environment's, if it has one).
    `cpu_threads`: each CPU process's threads, the cores of the slot it holds (the worker knows them);
    without it, this machine's cores shared among the job's processes."""
    command = _accelerate_launch(spec, run_dir, rendezvous, node_rank, python, cpu_threads)
    if spec.script is not None:
        args = list(spec.script.args)
        if resume_from is not None:
            args += [resume_arg(arg, resume_from, resume_step) for arg in spec.script.resume_args]
        return command + [spec.script.entrypoint, *args]
    command += [
        "-m", "workers.training", "--spec", str(run_dir / SPEC_FILE_NAME), "--stored", "--data-root", str(data_root), "--run-dir", str(run_dir),
    ]
    if resume_from is not None:
        command += ["--resume-from", str(resume_from)]
    if plugin_dir is not None:
        command += ["--plugin-dir", str(plugin_dir)]
    if skip_steps:  # after a rollback (workers/loss_guard.py)
        command += ["--skip-steps", str(skip_steps)]
    return command


def enter_job_env(command: Sequence[str], run_dir: Path, env: dict[str, str], init: bool = False) -> list[str]:
    """`command` started by workers/enter_job_env.py with the processes' environment `env`, written
    for it to the attempt's directory (readable by its owner only: the job's user once the sandbox
    has the directory). Whatever runs before it gets none of `env`. `init`: it is the PID namespace's
    first process, and the namespace ends with `command` (see there)."""
    env_file = run_dir / JOB_ENV_FILE_NAME
    env_file.unlink(missing_ok=True)
    with open(os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        json.dump(env, file)
    return [sys.executable, "-I", "-S", str(ENTER_JOB_ENV), *(["--init"] if init else []), str(env_file), "--", *command]


def resume_arg(arg: str, checkpoint: Path, step: int | None) -> str:
    """One of a script's `resume_args` with its placeholders filled in: the checkpoint's directory,
    its folder name as the script saved it (`step_1200`), its step."""
    filled = {"{checkpoint}": str(checkpoint), "{checkpoint_name}": checkpoint.name, "{step}": "" if step is None else str(step)}
    return re.sub("|".join(map(re.escape, filled)), lambda match: filled[match.group()], arg)


def training_environment(
    spec: JobSpec, run_dir: Path, resume_from: Path | None, device_ids: Sequence[int] | None = None
) -> dict[str, str]:
    """The environment of an attempt's processes: a script's clean one, else the worker's own
    without the service's settings and credentials; with `device_ids`, only those GPUs are visible (another job
    on this host has the others)."""
    if spec.script is not None:
        env = script_environment(spec, run_dir, resume_from)
    else:
        env = {name: value for name, value in os.environ.items() if not name.startswith(SERVICE_SETTINGS_PREFIX)}
        env.update({EVENTS_FILE_ENV: str(run_dir / EVENTS_FILE_NAME), "PYTHONUNBUFFERED": "1"})
    if device_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, device_ids))
    return env


def script_environment(spec: JobSpec, run_dir: Path, resume_from: Path | None) -> dict[str, str]:
    """The whole environment of a script job's processes (the launcher's own additions aside):
    what it inherits, the job's own `script.env`, and Trainyard's (which the spec can't override)."""
    env = {name: os.environ[name] for name in SCRIPT_INHERITED_ENV if name in os.environ}
    env.update(spec.script.env)
    env.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPT_SITE), spec.script.env.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        EVENTS_FILE_ENV: str(run_dir / EVENTS_FILE_NAME),
        CHECKPOINT_DIR_ENV: str(run_dir / "checkpoints"),
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(spec.training.gradient_accumulation_steps),
    })
    if spec.resources.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"  # several processes on CPU meet over gloo (`--cpu` would run just one)
    if resume_from is not None:
        env[RESUME_FROM_ENV] = str(resume_from)
    return env


def process_threads(spec: JobSpec, cpu_threads: int | None) -> int:
    """Each CPU process's threads: the cores of its slot (`cpu_threads`, as the worker knows them),
    else this machine's cores shared among the job's processes. Never more than the cores a process's
    slot stands for: two 2-thread processes sharing 2 cores stepped 22x slower than 1-thread ones
    (each thread's barrier spins while the other process holds its core)."""
    return cpu_threads or max(1, (os.cpu_count() or 1) // spec.resources.processes_per_node)


def _accelerate_launch(spec: JobSpec, run_dir: Path, rendezvous: str, node_rank: int, python: str, cpu_threads: int | None) -> list[str]:
    resources = spec.resources
    address, _, port = rendezvous.rpartition(":")
    command = [
        python, "-m", "accelerate.commands.launch",
        "--num_processes", str(spec.world_size),
        "--num_machines", str(resources.nodes),
        "--machine_rank", str(node_rank),
        "--main_process_ip", address,
        "--main_process_port", port,
        "--mixed_precision", spec.training.precision,
        "--dynamo_backend", "no",
    ]
    if resources.device == "cpu":
        # Passed explicitly (the launcher warns otherwise).
        command += ["--num_cpu_threads_per_process", str(process_threads(spec, cpu_threads))]
    if spec.world_size > 1:
        # torchrun prefixes each process's output with `[default<local rank>]:` (see supervisor.split_rank).
        command += ["--tee", "3", "--log_dir", str(run_dir / "rank-logs")]
        # "One process per device, torchrun-style": gloo on CPU (the loop's Accelerator(cpu=True)
        # picks it), NCCL on GPUs. Accelerate's --cpu flag would run a single process instead.
        command.append("--multi_gpu")
    elif resources.device == "cpu":
        command.append("--cpu")
    return command
