"""The client commands through `trainyard.cli.main`, against the fake API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from api_schemas import JobSpec, JobStatus
from tests.client.fake_server import GOOD_CHECKPOINT, TOKEN
from tests.helpers import EXAMPLE_SPEC, tiny_spec
from trainyard.cli import main
from trainyard.client_cli import SpecFileError, load_spec_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def trainyard(fake_api, capsys, monkeypatch):
    """Run `trainyard ARGS…` against the fake API; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr("trainyard.client.time.sleep", lambda seconds: None)  # no real waits between polls
    monkeypatch.setenv("TRAINYARD_SERVER", fake_api[0])
    monkeypatch.setenv("TRAINYARD_TOKEN", TOKEN)

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_spec_files_load_from_json_and_yaml(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps(EXAMPLE_SPEC))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(EXAMPLE_SPEC))
    assert load_spec_file(tmp_path / "spec.json") == load_spec_file(tmp_path / "spec.yaml") == EXAMPLE_SPEC
    JobSpec.model_validate(load_spec_file(tmp_path / "spec.yaml"))


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("spec.yaml", "name: x\nmodel: [unclosed\n", r"(?s)spec.yaml is not valid YAML: .*line 2, column 8"),
        ("spec.json", '{"name": "x",}', r"spec.json is not valid JSON: .*line 1 column 14"),
        ("spec.yml", "- a list\n", "expected a mapping of spec fields at the top level, got list"),
        ("missing.yaml", None, "cannot read .*missing.yaml: No such file or directory"),
    ],
)
def test_unreadable_spec_files_say_why(tmp_path, name, text, reason):
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(SpecFileError, match=reason):
        load_spec_file(tmp_path / name)


def test_submit_and_follow_to_success(trainyard, tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(tiny_spec()))
    code, out, err = trainyard("submit", str(tmp_path / "job.yaml"), "--follow")
    assert code == 0, err
    assert out.splitlines() == ["submitted job 99 (shakespeare-char): queued", "job 99 succeeded at step 12/12"]
    assert "running    [" in err and "loss 1.0000" in err  # the progress lines, on stderr


def test_the_gan_example_spec_submits_and_follows_to_success(trainyard):
    # A custom job has no tokens per sample: the progress line leaves the rate out.
    code, out, err = trainyard("submit", str(REPO / "examples" / "gan.json"), "--follow")
    assert code == 0, err
    assert out.splitlines() == ["submitted job 99 (gan-ring): queued", "job 99 succeeded at step 12/2000"]
    assert "running    [" in err and "tok/s" not in err


def test_follow_exits_1_with_the_failure_reason(trainyard, fake_api, tmp_path):
    fake_api[1].statuses = [JobStatus.running, JobStatus.failed]
    fake_api[1].failure_reason = "training process exited with code 1"
    (tmp_path / "job.json").write_text(json.dumps(tiny_spec()))
    code, _, err = trainyard("submit", str(tmp_path / "job.json"), "--follow")
    assert code == 1
    assert err.splitlines()[-1] == "job 99 failed: training process exited with code 1"


def test_bad_input_exits_2_without_a_traceback(trainyard, tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(tiny_spec(**{"model.n_head": 3})))
    code, _, err = trainyard("submit", str(tmp_path / "job.yaml"))
    assert code == 2
    assert err.splitlines() == [
        "error: the server rejected the request (HTTP 422):",
        "  model: n_embd (32) must be divisible by n_head (3)",
    ]
    assert trainyard("submit", str(tmp_path / "nope.yaml"))[0] == 2


def test_server_errors_exit_1_with_the_reason(trainyard):
    assert trainyard("status", "7") == (1, "", "error: job not found (HTTP 404)\n")
    code, _, err = trainyard("ls", "--server", "http://127.0.0.1:9", "--token", "x")  # the options override the env
    assert (code, err) == (1, "error: cannot reach Trainyard at http://127.0.0.1:9 — is `trainyard up` running?\n")


def test_ls_lists_the_newest_jobs(trainyard):
    code, out, _ = trainyard("ls", "--limit", "3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATUS", "STEP", "OWNER", "CREATED"]
    assert [line.split()[0] for line in lines[1:]] == ["5", "4", "3"]


def test_download_writes_the_verified_file(trainyard, tmp_path, model_bytes):
    dest = tmp_path / "model.safetensors"
    code, out, _ = trainyard("download", str(GOOD_CHECKPOINT), "-o", str(dest))
    assert (code, out) == (0, f"saved {dest} (sha256 verified)\n")
    assert dest.read_bytes() == model_bytes
