"""What an attempt's processes are started with (workers/launch.py): built from the spec alone (one test runs the
last step into the sandbox, workers/enter_job_env.py, to see the environment it gives)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from api_schemas import JobSpec
from tests.helpers import job_spec
from stack.embedded import host_cores
from workers.limits import SlotShare
from workers.launch import JOB_ENV_FILE_NAME, enter_job_env, launch_command, script_environment, training_environment, working_dir


def script_job(**fields) -> JobSpec:
    return JobSpec.model_validate({"name": "mine", "script": {"entrypoint": "train.py", "code": {"path": "project"}}, **fields})


def test_a_two_process_job_is_one_accelerate_launch_of_the_training_entry_point_with_a_log_per_rank(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    spec = job_spec(**{"resources.processes_per_node": 2})
    checkpoint, plugins = tmp_path / "store" / "step-6", tmp_path / "plugins"
    command = launch_command(spec, tmp_path, tmp_path / "data", checkpoint, "10.0.0.1:29500", plugin_dir=plugins)
    assert command == [
        sys.executable, "-m", "accelerate.commands.launch",
        "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0",
        "--main_process_ip", "10.0.0.1", "--main_process_port", "29500",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--num_cpu_threads_per_process", "4",  # the 8 cores shared by the 2 processes
        "--tee", "3", "--log_dir", str(tmp_path / "rank-logs"), "--multi_gpu",  # one process per device, gloo on CPU
        "-m", "workers.training", "--spec", str(tmp_path / "spec.json"), "--stored", "--data-root", str(tmp_path / "data"),
        "--run-dir", str(tmp_path), "--resume-from", str(checkpoint), "--plugin-dir", str(plugins),
    ]
    single = launch_command(job_spec(), tmp_path, tmp_path / "data", None, "10.0.0.1:29500")
    assert "--cpu" in single and "--multi_gpu" not in single and "--tee" not in single and "--resume-from" not in single


def test_a_worker_gives_each_cpu_process_the_cores_of_its_slot_never_the_whole_machine(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [SlotShare.of_host(slots, None).cores for slots in (8, 2, 16)] == [1, 4, 1]  # at least a core each
    command = launch_command(job_spec(), tmp_path, tmp_path / "data", None, "10.0.0.1:29500", cpu_threads=1)
    assert command[command.index("--num_cpu_threads_per_process") + 1] == "1"


def test_local_worker_hosts_each_get_their_own_cores_as_separate_machines_would(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert host_cores(2) == [{0, 1}, {2, 3}] and host_cores(3) == [{0}, {1}, {2}]
    assert host_cores(0) == host_cores(1) == host_cores(5) == []  # one host has them all; too few to share: unpinned


def test_the_worker_launches_the_script_with_the_jobs_settings_in_a_clean_environment(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", "postgresql://secret@db/trainyard")
    monkeypatch.setenv("TRAINYARD_BROKER_URL", "redis://secret@redis")
    spec = script_job(
        script={"entrypoint": "train.py", "code": {"path": "project"}, "args": ["--lr", "3e-4"],
                "resume_args": ["--resume_from_checkpoint", "{checkpoint}"]},
        training={"precision": "bf16", "gradient_accumulation_steps": 4},
        resources={"nodes": 2, "processes_per_node": 2},
    )
    checkpoint = tmp_path / "jobs" / "1" / "checkpoints" / "step-00000050"
    command = launch_command(spec, tmp_path, tmp_path / "data", checkpoint, "10.0.0.1:29500", node_rank=1)
    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    assert flag("--num_processes") == "4" and flag("--num_machines") == "2" and flag("--machine_rank") == "1"
    assert flag("--main_process_ip") == "10.0.0.1" and flag("--main_process_port") == "29500" and flag("--mixed_precision") == "bf16"
    assert command[-5:] == ["train.py", "--lr", "3e-4", "--resume_from_checkpoint", str(checkpoint)]
    assert working_dir(spec, tmp_path) == tmp_path / "code"  # its own copy of its code

    env = training_environment(spec, tmp_path, checkpoint)
    assert env == script_environment(spec, tmp_path, checkpoint)
    assert "TRAINYARD_DATABASE_URL" not in env and not any("secret" in value for value in env.values())
    assert set(env) <= {"PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONUNBUFFERED", "ACCELERATE_USE_CPU",
                        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "TRAINYARD_EVENTS_FILE", "TRAINYARD_CHECKPOINT_DIR", "TRAINYARD_RESUME_FROM"}
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4" and env["TRAINYARD_RESUME_FROM"] == str(checkpoint)
    assert (Path(env["PYTHONPATH"]) / "sitecustomize.py").is_file()


def test_a_built_in_jobs_processes_get_the_workers_environment_without_the_service_credentials(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", "postgresql://secret@db/trainyard")
    monkeypatch.setenv("TRAINYARD_BROKER_URL", "redis://secret@redis")
    monkeypatch.setenv("TRAINYARD_DATA_DIR", "/srv/trainyard-secrets")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = training_environment(job_spec(), tmp_path, None)
    assert not any("secret" in value for value in env.values()) and env["OMP_NUM_THREADS"] == "3"
    assert env["TRAINYARD_EVENTS_FILE"] == str(tmp_path / "events.jsonl")
    assert working_dir(job_spec(), tmp_path) == tmp_path


def test_an_attempt_sees_only_the_gpus_reserved_for_it(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the host's: another job has the others
    assert training_environment(job_spec(), tmp_path, None, device_ids=[2, 3])["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert training_environment(script_job(), tmp_path, None, device_ids=[1])["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in training_environment(script_job(), tmp_path, None)  # a script inherits none


def test_resume_args_name_the_checkpoint_as_the_script_saved_it_with_its_name_and_step(tmp_path: Path):
    spec = script_job(script={
        "entrypoint": "train.py", "code": {"path": "project"},
        "resume_args": ["--resume_from_checkpoint", "{checkpoint}", "--name={checkpoint_name}", "--step", "{step}"],
    })
    checkpoint = tmp_path / "jobs" / "1" / "checkpoints" / "attempt-1.3" / "step_1200"
    command = launch_command(spec, tmp_path, tmp_path / "data", checkpoint, "10.0.0.1:29500", resume_step=1200)
    assert command[-6:] == ["train.py", "--resume_from_checkpoint", str(checkpoint), "--name=step_1200", "--step", "1200"]
    assert launch_command(spec, tmp_path, tmp_path / "data", None, "10.0.0.1:29500")[-1] == "train.py"  # a first attempt resumes nothing


def test_a_scripts_own_env_reaches_it_and_trainyards_names_cannot_be_set(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", "postgresql://secret@db/trainyard")
    spec = script_job(script={
        "entrypoint": "train.py", "code": {"path": "project"}, "env": {"HF_HUB_OFFLINE": "1", "PYTHONPATH": "/opt/lib"},
    })
    env = training_environment(spec, tmp_path, None)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(Path(env["PYTHONPATH"].split(os.pathsep)[0])), "/opt/lib"]
    assert (Path(env["PYTHONPATH"].split(os.pathsep)[0]) / "sitecustomize.py").is_file()  # Trainyard's hooks first
    assert not any("secret" in value for value in env.values())
    for name in ["TRAINYARD_EVENTS_FILE", "trainyard_database_url", "CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU", "1BAD", "A-B"]:
        with pytest.raises(ValidationError):
            script_job(script={"entrypoint": "train.py", "code": {"path": "project"}, "env": {name: "x"}})


def test_the_jobs_environment_reaches_only_the_command_after_the_last_step_in(tmp_path: Path):
    # What runs before enter_job_env.py (the shell, bwrap, setpriv: the worker's user) starts with an
    # empty environment; the job's, LD_PRELOAD and all, is given to its command alone, and its file is gone.
    job_env = {"LD_PRELOAD": "./evil.so", "PATH": "./bin:/usr/bin", "HF_TOKEN": "hf_secret", "HOME": "/home/mallory"}
    command = enter_job_env([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"], tmp_path, job_env)
    assert "hf_secret" not in " ".join(command)  # never on a command line `ps` shows
    env_file = tmp_path / JOB_ENV_FILE_NAME
    assert env_file.stat().st_mode & 0o077 == 0
    job_env["LD_PRELOAD"] = ""  # a missing library would only be warned about, but keep the run quiet
    env_file.write_text(json.dumps(job_env))
    seen = json.loads(subprocess.run(command, env={"HOME": "/tmp"}, capture_output=True, text=True, check=True).stdout)
    assert seen["HF_TOKEN"] == "hf_secret" and seen["PATH"] == "./bin:/usr/bin"
    assert seen["HOME"] == "/tmp"  # what the sandbox sets itself is kept
    assert not env_file.exists()


def test_as_init_the_last_step_outlives_its_command_only_to_exit_with_its_status(tmp_path: Path):
    # In the sandbox it is PID 1, and the namespace (daemons and all) ends when it exits; here, its status.
    command = enter_job_env([sys.executable, "-c", "import os, sys; print(os.environ['SEEN']); sys.exit(3)"], tmp_path, {"SEEN": "yes"}, init=True)
    assert "--init" in command
    done = subprocess.run(command, env={}, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (3, "yes"), done.stderr
