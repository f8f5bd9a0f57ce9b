"""The client commands through `trainyard.cli.main`, against the real API app served by uvicorn (SQLite)."""

from __future__ import annotations

import io
import json
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from api_schemas import AttemptStatus, JobSpec
from common.artifacts import ArtifactStore
from tests.client.conftest import run_next_job
from tests.helpers import EXAMPLE_SPEC, start_job, tiny_spec
from tests.sweep_helpers import run_sweep, sweep_spec
from service.db.attempts import finish_attempt
from service.db.hosts import register_host
from service.db.log_lines import record_logs
from service.db.outputs import record_output
from service.db.models import User
from service.db.session import session_factory
from service.scheduler import schedule_pass
from trainyard.cli import main
from trainyard.client import bundle_code
from trainyard.client_cli import SpecFileError, load_spec_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def trainyard(api_url, token, capsys, monkeypatch):
    """Run `trainyard ARGS…` against the API; returns (exit code, stdout, stderr)."""
    real_sleep = time.sleep
    monkeypatch.setattr("trainyard.client.time.sleep", lambda seconds: real_sleep(min(seconds, 0.05)))  # poll often
    monkeypatch.setenv("TRAINYARD_SERVER", api_url)
    monkeypatch.setenv("TRAINYARD_TOKEN", token)

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's refusals
            code = exit.code
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
        ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{\xff}", r"model.safetensors is not a text file \(byte 9 is not UTF-8\): a spec is a JSON or YAML file"),
        ("bin.json", b"\xff\xfe", r"bin.json is not a text file"),
        ("empty.yaml", "", "empty.yaml is empty: expected a mapping of spec fields"),
    ],
)
def test_unreadable_spec_files_say_why(tmp_path, name, text, reason):
    if isinstance(text, bytes):
        (tmp_path / name).write_bytes(text)
    elif text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(SpecFileError, match=reason):
        load_spec_file(tmp_path / name)


def test_submit_and_follow_to_success(trainyard, settings, progress_seen_running, tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(tiny_spec()))
    with ThreadPoolExecutor(1) as worker:
        ran = worker.submit(run_next_job, settings, progress_seen_running)
        code, out, err = trainyard("submit", str(tmp_path / "job.yaml"), "--follow")
        job_id = ran.result()
    assert code == 0, err
    assert out.splitlines() == [f"submitted job {job_id} (shakespeare-char): queued", f"job {job_id} succeeded at step 12/12"]
    assert "running    [" in err and "loss 1.0000" in err  # the progress lines, on stderr


def test_the_gan_example_spec_submits_and_follows_to_success(trainyard, settings, progress_seen_running):
    # A custom job has no tokens per sample: the progress line leaves the rate out.
    with ThreadPoolExecutor(1) as worker:
        ran = worker.submit(run_next_job, settings, progress_seen_running)
        code, out, err = trainyard("submit", str(REPO / "examples" / "gan.json"), "--follow")
        job_id = ran.result()
    assert code == 0, err
    assert out.splitlines() == [f"submitted job {job_id} (gan-ring): queued", f"job {job_id} succeeded at step 12/2000"]
    assert "running    [" in err and "tok/s" not in err


def test_follow_exits_1_with_the_failure_reason(trainyard, settings, progress_seen_running, tmp_path):
    (tmp_path / "job.json").write_text(json.dumps(tiny_spec(max_restarts=0)))
    with ThreadPoolExecutor(1) as worker:
        ran = worker.submit(run_next_job, settings, progress_seen_running, AttemptStatus.failed, "training process exited with code 1")
        code, _, err = trainyard("submit", str(tmp_path / "job.json"), "--follow")
        job_id = ran.result()
    assert code == 1
    assert err.splitlines()[-1] == f"job {job_id} failed: attempt 1 failed: training process exited with code 1"


def test_bad_input_exits_2_without_a_traceback(trainyard, tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(tiny_spec(**{"model.n_head": 3})))
    code, _, err = trainyard("submit", str(tmp_path / "job.yaml"))
    assert code == 2
    assert err.splitlines() == [
        "error: the server rejected the request (HTTP 422):",
        "  model: n_embd (32) must be divisible by n_head (3)",
    ]
    assert trainyard("submit", str(tmp_path / "nope.yaml"))[0] == 2
    # A file that isn't there or isn't a file, a count below 1: a message, never a traceback.
    for path in (tmp_path / "nope.txt", tmp_path):
        code, _, err = trainyard("datasets", "upload", str(path))
        assert code != 0 and err.startswith(f"error: cannot read {path}: ") and "Traceback" not in err
    for command in (["ls"], ["audit"], ["usage"], ["sweep", "ls"]):
        code, _, err = trainyard(*command, "--limit", "-1")
        assert code == 2 and "--limit: -1: give 1 or more" in err, command


def test_server_errors_exit_1_with_the_reason(trainyard):
    assert trainyard("status", "7") == (1, "", "error: job not found (HTTP 404)\n")
    code, _, err = trainyard("ls", "--server", "http://127.0.0.1:9", "--token", "x")  # the options override the env
    assert (code, err) == (1, "error: cannot reach Trainyard at http://127.0.0.1:9 — is `trainyard up` running?\n")
    # Before the command too (`trainyard --token X ls` was "invalid choice: 'X'"); after it, it wins.
    code, _, err = trainyard("--server", "http://127.0.0.1:9", "--token", "x", "ls")
    assert (code, err) == (1, "error: cannot reach Trainyard at http://127.0.0.1:9 — is `trainyard up` running?\n")
    assert trainyard("--server", "http://127.0.0.1:9", "status", "7", "--server", "http://127.0.0.1:10")[2].endswith("127.0.0.1:10 — is `trainyard up` running?\n")


def test_ls_lists_the_newest_jobs(trainyard, tmp_path):
    (tmp_path / "job.json").write_text(json.dumps(tiny_spec()))
    submitted = [int(trainyard("submit", str(tmp_path / "job.json"))[1].split()[2]) for _ in range(5)]
    code, out, _ = trainyard("ls", "--limit", "3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATUS", "STEP", "OWNER", "CREATED"]
    assert [int(line.split()[0]) for line in lines[1:]] == submitted[:1:-1]


def test_status_of_a_multi_node_job_shows_which_node_each_attempt_row_is(trainyard, settings, tmp_path):
    (tmp_path / "two.json").write_text(json.dumps(tiny_spec(**{"resources.nodes": 2})))
    job_id = int(trainyard("submit", str(tmp_path / "two.json"))[1].split()[2])
    with session_factory(settings.resolved_database_url)() as session:
        for i in range(2):
            register_host(session, f"host-{i}", "cpu", 1, {}, address=f"10.0.0.{i}")
        assert len(schedule_pass(session, settings)) == 2
    code, out, _ = trainyard("status", str(job_id))
    assert code == 0
    table = out.split("\n\n", 1)[1].splitlines()
    assert table[0].split()[:4] == ["ATTEMPT", "NODE", "HOST", "PROCESSES"]
    rows = [row.split()[:3] for row in table[1:]]
    assert sorted(node for _, node, _ in rows) == ["0", "1"] and sorted(host for _, _, host in rows) == ["host-0", "host-1"]
    # For scripts: the job as the API gives it, and the list.
    code, out, _ = trainyard("status", str(job_id), "--json")
    job = json.loads(out)
    assert code == 0 and job["id"] == job_id and sorted(a["host_name"] for a in job["attempts"]) == ["host-0", "host-1"]
    assert sorted(a["node_rank"] for a in job["attempts"]) == [0, 1]
    code, out, _ = trainyard("ls", "--json")
    assert code == 0 and [(j["id"], j["status"]) for j in json.loads(out)] == [(job_id, job["status"])]


def test_status_says_why_each_attempt_that_did_not_succeed_ended(trainyard, settings, tmp_path):
    # Found by a new user: once the job succeeded, its lost attempt's reason was shown by --json alone.
    (tmp_path / "job.json").write_text(json.dumps(tiny_spec()))
    job_id = int(trainyard("submit", str(tmp_path / "job.json"))[1].split()[2])
    claimed = start_job(settings, job_id)
    with session_factory(settings.resolved_database_url)() as session:
        finish_attempt(session, claimed, AttemptStatus.failed, "training process exited with code 137 (killed)\nits last line")
        assert len(schedule_pass(session, settings)) == 1
    code, out, _ = trainyard("status", str(job_id))
    table = out.split("\n\n", 1)[1].splitlines()
    assert code == 0 and table[0].split()[-1] == "REASON"
    assert table[1].split()[:5] == ["1", "host-a", "1", "failed", "-"] and table[1].endswith("training process exited with code 137 (killed)…")
    assert table[2].split()[3] == "scheduled" and table[2].rstrip().endswith("-")


def test_a_sweep_submitted_listed_and_shown_prints_its_best_spec_ready_to_submit(trainyard, settings, tmp_path):
    spec_file = tmp_path / "sweep.json"
    spec_file.write_text(json.dumps(sweep_spec()))

    code, out, _ = trainyard("sweep", "submit", str(spec_file))
    assert code == 0 and out.startswith("sweep 1 (search) submitted: up to 10 trials, 2 at a time")
    run_sweep(settings, 1)

    code, out, _ = trainyard("sweep", "ls")
    assert code == 0 and out.splitlines()[1].split()[:4] == ["1", "search", "succeeded", "4/10"]
    code, out, _ = trainyard("sweep", "show", "1")
    assert code == 0
    table, best = out.split("\nbest: trial ")
    assert len(table.splitlines()) == 2 + 4  # the heading line, the table's, a row per trial
    assert all(" succeeded " in row for row in table.splitlines()[2:])
    best_spec = JobSpec.model_validate(json.loads(best.split(":\n", 1)[1]))
    assert best_spec.optimizer.lr == 0.003

    code, out, _ = trainyard("sweep", "cancel", "1")
    assert code == 0 and out.strip() == "sweep 1: succeeded"  # it had ended: nothing to cancel


def test_a_sweep_with_a_bad_base_spec_exits_1_naming_the_field(trainyard, tmp_path):
    spec = sweep_spec()
    spec["base"]["optimizer"]["lr"] = -1
    (tmp_path / "sweep.json").write_text(json.dumps(spec))
    code, _, err = trainyard("sweep", "submit", str(tmp_path / "sweep.json"))
    assert code != 0 and "base.optimizer.lr" in err


def test_compare_prints_the_spec_fields_that_differ_and_the_final_metrics_side_by_side(trainyard, settings, tmp_path):
    from service.db.metrics import record_metrics
    from service.db.session import session_factory
    from service.db.attempts import finish_attempt
    from tests.helpers import start_job

    ids = []
    for lr, loss in ((0.001, 2.5), (0.00100004, 1.75)):  # learning rates apart past the fourth digit
        (tmp_path / "spec.json").write_text(json.dumps(tiny_spec(**{"optimizer.lr": lr})))
        ids.append(int(trainyard("submit", str(tmp_path / "spec.json"))[1].split()[2]))
        claimed = start_job(settings, ids[-1])
        with session_factory(settings.resolved_database_url)() as session:
            points = [(6, "train_loss", 9.0), (12, "train_loss", loss), (12, "eval_loss", loss + 0.25), (12, "sys/cpu_percent", 0.0)]
            record_metrics(session, ids[-1], claimed.attempt_id, points)  # the worker's sample of the machine is no result: not shown
            finish_attempt(session, claimed, AttemptStatus.succeeded, None)  # its slot free for the next
    code, out, _ = trainyard("compare", str(ids[0]), str(ids[1]))
    assert code == 0
    lines = out.splitlines()
    first, second = f"JOB {ids[0]} (shakespeare-char)", f"JOB {ids[1]} (shakespeare-char)"
    assert lines[1].split("  ")[0] == "SPEC FIELD" and first in lines[1] and second in lines[1]
    assert lines[2].split() == ["optimizer.lr", "0.001", "0.00100004"] and not lines[3]  # the one field that differs, every digit
    assert [line.split() for line in lines[5:]] == [["eval_loss", "2.75", "2"], ["train_loss", "2.5", "1.75"]]

    # Given two ids, a missing one is named; and the first job, ended, has nothing to cancel.
    for command in ("compare", "diff"):
        code, _, err = trainyard(command, str(ids[0]), "999")
        assert code == 1 and "job 999 not found" in err, err
    code, out, _ = trainyard("cancel", str(ids[0]))
    assert code == 0 and out.strip() == f"job {ids[0]} had already ended (succeeded): nothing to cancel"


def test_download_state_into_a_file_name_is_refused_saying_what_o_names(trainyard, tmp_path):
    # `download --state -o x.tar` made a directory named x.tar.
    code, _, err = trainyard("download", "1", "--state", "-o", str(tmp_path / "x.tar"))
    assert code == 2 and "-o names that directory" in err and not (tmp_path / "x.tar").exists()


def test_checkpoints_shows_the_metric_a_job_keeps_its_best_by_and_marks_the_best(trainyard, settings, data_root, tmp_path):
    from api_schemas import CheckpointConfig
    from service.db.checkpoints import record_checkpoint
    from service.db.metrics import record_metrics
    from tests.helpers import classifier_spec, start_job, write_labelled_jsonl

    write_labelled_jsonl(data_root / "labels.jsonl")
    policy = {"keep_last": 1, "keep_best": True, "best_metric": "eval_accuracy", "best_mode": "max"}
    (tmp_path / "job.json").write_text(json.dumps(classifier_spec(checkpoint=policy)))
    job_id = int(trainyard("submit", str(tmp_path / "job.json"))[1].split()[2])
    claimed = start_job(settings, job_id)
    with session_factory(settings.resolved_database_url)() as session:
        for step, accuracy in ((10, 0.9), (20, 0.7)):  # the later one worse: kept as the newest, the earlier as the best
            record_metrics(session, job_id, claimed.attempt_id, [(step, "eval_loss", 1 - accuracy), (step, "eval_accuracy", accuracy)])
            record_checkpoint(session, job_id, claimed.attempt_id, step, f"ck/{step}", "0" * 64, 10, 1, best=CheckpointConfig(**policy))
    code, out, _ = trainyard("checkpoints", str(job_id))
    assert code == 0 and [line.split()[1:5] for line in out.splitlines()[:2]] == [["STEP", "EVAL_LOSS", "EVAL_ACCURACY", "BEST"], ["10", "0.1000", "0.9", "best"]]
    assert out.splitlines()[2].split()[1:4] == ["20", "0.3000", "0.7"] and "best" not in out.splitlines()[2]


def test_spec_prints_a_jobs_spec_that_submits_again_and_checkpoints_says_when_there_are_none(trainyard, tmp_path):
    (tmp_path / "job.json").write_text(json.dumps(tiny_spec(**{"optimizer.lr": 0.003})))
    job_id = trainyard("submit", str(tmp_path / "job.json"))[1].split()[2]
    code, out, _ = trainyard("spec", job_id)
    assert code == 0 and yaml.safe_load(out)["optimizer"]["lr"] == 0.003
    (tmp_path / "again.yaml").write_text(out)
    assert trainyard("submit", str(tmp_path / "again.yaml"))[0] == 0  # the printed spec is one the server takes
    assert json.loads(trainyard("spec", job_id, "--json")[1])["optimizer"]["lr"] == 0.003
    assert trainyard("checkpoints", job_id) == (0, f"job {job_id} has no checkpoints yet\n", "")
    assert trainyard("checkpoints", job_id, "--json") == (0, "[]\n", "")
    code, out, err = trainyard("outputs", job_id, "-o", str(tmp_path / "out"))  # a built-in job collects none: said, not silence
    assert (code, out) == (1, "") and err.startswith(f"error: job {job_id} has no collected outputs")


def test_outputs_unpacks_an_output_of_no_files_as_an_empty_directory(trainyard, settings, tmp_path):
    # A script's output directory that held only its save_state folders (taken in as checkpoints):
    # collected with no files, its tar a manifest alone. The CLI failed on it with a traceback.
    (tmp_path / "job.json").write_text(json.dumps(tiny_spec()))
    job_id = int(trainyard("submit", str(tmp_path / "job.json"))[1].split()[2])
    claimed = start_job(settings, job_id)
    (tmp_path / "empty" / "out").mkdir(parents=True)
    stored = ArtifactStore(settings.resolved_artifact_root).ingest_output(tmp_path / "empty" / "out", job_id, "out", 20)
    with session_factory(settings.resolved_database_url)() as session:
        record_output(session, job_id, claimed.attempt_id, "out", 20, *stored)
    code, out, err = trainyard("outputs", str(job_id), "-o", str(tmp_path / "results"))
    assert (code, err) == (0, "") and out.startswith(f"saved {tmp_path / 'results' / 'out'}/: empty, as collected")
    assert f"`trainyard checkpoints {job_id}`" in out  # where its save_state folders went
    assert (tmp_path / "results" / "out").is_dir() and not any((tmp_path / "results" / "out").iterdir())


def test_a_spec_file_given_with_script_is_refused_not_taken_for_the_scripts_argument(trainyard, tmp_path):
    # It became the script's first argument: the script failed on it, on every restart.
    (tmp_path / "spec.json").write_text(json.dumps(tiny_spec()))
    (tmp_path / "train.py").write_text("print('trained')\n")
    code, out, err = trainyard("submit", str(tmp_path / "spec.json"), "--script", str(tmp_path / "train.py"))
    assert (code, out) == (2, "") and "error: a spec file" in err and "and --script are two ways to submit: give one" in err, err


def test_words_after_a_spec_file_are_refused_saying_a_spec_file_takes_none(trainyard, tmp_path):
    # It said "give a job spec file", one having been given.
    (tmp_path / "spec.json").write_text(json.dumps(tiny_spec()))
    code, out, err = trainyard("submit", str(tmp_path / "spec.json"), "extra", "args")
    assert (code, out) == (2, "") and "a spec file takes no more arguments (extra args)" in err, err
    code, out, err = trainyard("submit")
    assert (code, out) == (2, "") and "give a job spec file, or --script FILE" in err, err


def test_a_scripts_argument_given_before_dashes_is_refused_saying_where_it_goes(trainyard, tmp_path):
    (tmp_path / "train.py").write_text("print('trained')\n")
    code, out, err = trainyard("submit", "--script", str(tmp_path / "train.py"), "--max_steps", "20")
    assert (code, out) == (2, "")
    assert f"unrecognized arguments: --max_steps (a script's own arguments go after `--`: trainyard submit --script {tmp_path / 'train.py'} -- --max_steps 20)" in err, err
    assert "unrecognized arguments: --nope" in trainyard("ls", "--nope")[2]  # other commands: argparse's words


def test_a_code_bundle_sends_linked_files_and_names_what_it_leaves_out(tmp_path):
    # Found by a new user: a corpus linked in beside the script was left out without a word, and
    # the job failed on FileNotFoundError.
    (elsewhere := tmp_path / "elsewhere").mkdir()
    (elsewhere / "corpus.txt").write_text("to be or not to be\n")
    (project := tmp_path / "project").mkdir()
    (project / "train.py").write_text("print('trained')\n")
    (project / "corpus.txt").symlink_to(elsewhere / "corpus.txt")
    (project / "data").symlink_to(elsewhere)
    (project / ".env").write_text("SECRET=1\n")
    (project / ".git").mkdir()
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    left_out: list[str] = []
    with tarfile.open(fileobj=io.BytesIO(bundle_code(project, left_out))) as tar:
        assert sorted(tar.getnames()) == ["corpus.txt", "train.py"]
        assert tar.getmember("corpus.txt").isfile() and tar.extractfile("corpus.txt").read() == b"to be or not to be\n"
    assert left_out == [".env", "data (a link to a directory)"]  # .git goes unsaid: version control is never sent


def test_logs_of_a_job_of_several_processes_say_each_lines_rank(trainyard, settings, tmp_path):
    # Found by a new user: two processes' lines interleaved with nothing to tell them apart.
    (tmp_path / "spec.json").write_text(json.dumps(tiny_spec(**{"resources.processes_per_node": 2})))
    code, out, _ = trainyard("submit", str(tmp_path / "spec.json"))
    job_id = int(out.split()[2])  # "submitted job N (…): queued"
    claimed = start_job(settings, job_id, slots=2)
    with session_factory(settings.resolved_database_url)() as session:
        record_logs(session, job_id, claimed, [(1, 0, "step 1 on 0"), (2, 1, "step 1 on 1"), (3, None, "launcher says")])
    code, out, _ = trainyard("logs", str(job_id))
    assert code == 0 and out.splitlines() == ["--- attempt 1 ---", "[rank 0] step 1 on 0", "[rank 1] step 1 on 1", "launcher says"]
    code, out, _ = trainyard("logs", str(job_id), "--rank", "1")
    assert code == 0 and out.splitlines() == ["--- attempt 1 ---", "step 1 on 1"]


def test_a_script_goes_to_a_cluster_pool_with_pool(trainyard, settings, tmp_path):
    # A script for the team's Slurm pool took a round trip through `trainyard spec` and an edited file.
    with session_factory(settings.resolved_database_url)() as session:
        session.scalar(select(User).where(User.name == "alice")).can_run_code = True
        session.commit()
    (tmp_path / "train.py").write_text("print('trained')\n")
    code, out, err = trainyard("submit", "--script", str(tmp_path / "train.py"), "--pool", "gpu-cluster")
    assert (code, out) == (2, "") and "resources.pool: no pool named 'gpu-cluster'" in err, err
