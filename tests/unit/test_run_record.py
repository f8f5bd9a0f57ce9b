"""A run record's parts (workers/run_environment.py, trainyard/record_cli.py): inputs' digests as the
worker takes them, a rerun's changed input named, a rerun's spec pinned to what the job ran with."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from api_schemas import JobSpec
from api_schemas.run_record import AttemptEnvironment, RunEnvironment, RunRecord
from common.settings import Settings
from tests.helpers import job_spec
from trainyard.client import TrainyardError
from trainyard.compare_cli import ABSENT
from trainyard.record_cli import environment_differences, rerun_spec
from workers.run_environment import changed_inputs, digest, input_digests, packages


def test_inputs_are_digested_by_their_names_in_the_record_a_directory_by_its_files(tmp_path: Path):
    settings = Settings(data_dir=tmp_path)
    data = settings.resolved_data_root
    (data / "model" / "sub").mkdir(parents=True)
    (data / "corpus.txt").write_text("to be or not to be")
    (data / "model" / "config.json").write_text("{}")
    (data / "model" / "sub" / "weights.bin").write_bytes(b"\0" * 10)
    spec = job_spec(**{"dataset.path": "corpus.txt"})
    assert input_digests(spec, settings, data) == {"corpus.txt": hashlib.sha256(b"to be or not to be").hexdigest()}
    before = digest(data / "model")
    (data / "model" / "sub" / "weights.bin").write_bytes(b"\1" * 10)  # same names and sizes, other content
    assert digest(data / "model") != before
    (data / "model" / "sub" / "weights.bin").rename(data / "model" / "weights.bin")  # same content, other name
    assert len({before, digest(data / "model")}) == 2
    # Other bytes under the same size and mtime (`cp -p`, `rsync -t`): not the cached digest.
    corpus = data / "corpus.txt"
    first, times = digest(corpus), (corpus.stat().st_atime_ns, corpus.stat().st_mtime_ns)
    time.sleep(0.05)  # past the filesystem's clock tick (coarse: a jiffy), so the ctime moves
    corpus.write_text("to be or not to go")
    os.utime(corpus, ns=times)
    assert digest(corpus) == hashlib.sha256(b"to be or not to go").hexdigest() != first


def test_a_changed_or_missing_input_is_named():
    expected = {"a.txt": "1" * 64, "b.txt": "2" * 64}
    assert changed_inputs(expected, dict(expected)) is None
    assert changed_inputs(expected, {"a.txt": "1" * 64, "b.txt": "3" * 64}).startswith("input b.txt changed since the job it reruns")
    assert changed_inputs(expected, {"b.txt": "2" * 64}).startswith("input a.txt is gone")
    assert packages()["pytest"] == pytest.__version__


def record_of(spec: dict, environment: RunEnvironment | None) -> RunRecord:
    attempt = AttemptEnvironment(attempt=1, node_rank=0, host_name="h", started_at=None, environment=environment)
    return RunRecord(job_id=7, name=spec["name"], spec=spec, code_sha256=None, attempts=[attempt])


def test_a_rerun_holds_the_inputs_it_read_and_pins_its_environment_to_what_it_resolved_to():
    spec = job_spec(environment={"pip": ["tqdm>=4"]}).model_dump(mode="json")
    ran = RunEnvironment(python="3.11.7", platform="p", device="cpu: x", packages={"torch": "2.13.0"},
                         environment_packages={"tqdm": "4.66.4", "colorama": "0.4.6", "torch": "2.13.0"}, inputs={"corpus.txt": "a" * 64})
    again = rerun_spec(record_of(spec, ran))
    assert again["inputs_sha256"] == {"corpus.txt": "a" * 64}
    assert again["environment"]["pip"] == ["colorama==0.4.6", "tqdm==4.66.4"]  # never the worker's own torch
    assert JobSpec.model_validate(again).inputs_sha256 == {"corpus.txt": "a" * 64}
    with pytest.raises(TrainyardError, match="never started"):
        rerun_spec(record_of(spec, None))
    # A rerun of a rerun that failed on a changed input keeps its pin, not the changed digest it found.
    failed_rerun = record_of({**spec, "inputs_sha256": {"corpus.txt": "a" * 64}}, ran.model_copy(update={"inputs": {"corpus.txt": "b" * 64}}))
    assert rerun_spec(failed_rerun)["inputs_sha256"] == {"corpus.txt": "a" * 64}
    other = ran.model_copy(update={"packages": {"torch": "2.14.1"}, "inputs": {}})
    assert environment_differences(ran, other) == [("inputs.corpus.txt", "a" * 64, ABSENT), ("packages.torch", "2.13.0", "2.14.1")]
    # Found by a new user: a rerun on a host of 1 thread a slot trained other weights than the run on
    # 2, and diff said nothing differed.
    two, one = ran.model_copy(update={"cpu_threads": 2}), ran.model_copy(update={"cpu_threads": 1})
    assert environment_differences(two, one) == [("cpu_threads", 2, 1)]


def test_a_rerun_of_a_job_whose_input_changed_between_attempts_says_so(capsys):
    spec = job_spec().model_dump(mode="json")
    ran = RunEnvironment(python="3.11.7", platform="p", device="cpu: x", packages={}, environment_packages={}, inputs={"corpus.txt": "a" * 64})
    record = record_of(spec, ran)
    record.attempts.append(record.attempts[0].model_copy(update={"attempt": 2, "environment": ran.model_copy(update={"inputs": {"corpus.txt": "b" * 64}})}))
    assert rerun_spec(record)["inputs_sha256"] == {"corpus.txt": "b" * 64}  # the latest, as the record's environment
    assert "attempts read different contents of corpus.txt" in capsys.readouterr().err
