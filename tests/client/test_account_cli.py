"""Tokens, usage and the audit trail from the command line: the server's `user` commands and the
client's `token rotate`, `usage` and `audit`, against the real API served by uvicorn (SQLite)."""

from __future__ import annotations

import httpx
import pytest
import yaml

from service.db.accounts import create_user
from service.db.hosts import register_host
from service.db.session import session_factory
from tests.helpers import tiny_spec
from trainyard.cli import main
from trainyard.client import Client


@pytest.fixture
def run(settings, api_url, capsys, monkeypatch, tmp_path):
    """Run `trainyard ARGS…` against the API and its database; returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("TRAINYARD_SERVER", api_url)
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.delenv("TRAINYARD_DATA_DIR", raising=False)  # the token file is then found going up from the working directory
    monkeypatch.setenv("TRAINYARD_CONFIG", str(tmp_path / "no-config.yaml"))
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse refusing an argument
            code = exit.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_an_admin_revokes_a_user_and_rotates_them_a_new_token(run, api_url):
    code, out, _ = run("user", "create", "carol", "--token-lifetime-days", "30")
    assert code == 0
    carol = out.strip()
    assert run("ls", "--token", carol)[0] == 0

    assert run("user", "revoke", "carol")[0] == 0
    code, _, err = run("ls", "--token", carol)
    assert code == 1 and "token revoked" in err
    # What an operator checks before `set` or `revoke` (there was no way to list users).
    code, out, _ = run("user", "ls")
    rows = [line.split() for line in out.splitlines()]
    assert code == 0 and rows[0] == ["NAME", "ADMIN", "CAN", "RUN", "CODE", "TOKEN", "CREATED"]
    carol_row = next(row for row in rows if row[0] == "carol")
    assert carol_row[1:4] == ["-", "-", "revoked"]

    code, out, _ = run("user", "rotate", "carol")
    assert code == 0 and run("ls", "--token", out.strip())[0] == 0
    assert run("user", "revoke", "nobody")[0] == 1
    for days in ("0", "3000000", "99999999999"):  # the last two were tracebacks: no date that far can be stored
        code, _, err = run("user", "create", "dave", "--token-lifetime-days", days)
        assert code == 2 and "must be more than 0 and at most 36,500" in err, err
    # A name is refused before it is stored: nothing the other commands, an audit line or a page would trip on.
    for bad in ("", "bad name", "../x", ".hidden"):
        code, _, err = run("user", "create", bad)
        assert code == 2 and "a user name is letters, digits and . _ @ + -, starting with a letter or digit" in err, bad
    assert run("user", "create", "erin.o'hara")[0] == 2 and run("user", "create", "erin@lab.example")[0] == 0
    for bad in ("", "bad host", "../x"):
        code, _, err = run("host", "token", bad)
        assert code == 2 and "a host name is letters, digits and . _ -" in err, bad
    assert run("host", "token", "gpu-01.lab")[0] == 0


def test_host_list_shows_every_token_revoked_or_not_and_whether_its_host_is_in_the_pool(run, settings):
    """GET /v1/workers lists registered hosts only: a revoked host left it, a new one had not joined."""
    assert run("host", "list")[1].strip() == "no host tokens yet: `trainyard host token NAME` makes one"
    for name in ("gpu-1", "gpu-2", "gpu-3"):
        assert run("host", "token", name)[0] == 0
    with session_factory(settings.resolved_database_url)() as session:
        register_host(session, "gpu-1", "cuda", 8, {})
        register_host(session, "gpu-2", "cuda", 8, {})
    assert run("host", "revoke", "gpu-2")[0] == 0
    code, out, _ = run("host", "list")
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert code == 0 and out.split()[:4] == ["HOST", "TOKEN", "ISSUED", "IN"]
    assert "works" in rows["gpu-1"] and "last heartbeat" in rows["gpu-1"]
    assert "revoked" in rows["gpu-2"] and rows["gpu-2"].endswith("-")  # taken out of the pool with its token
    assert "works" in rows["gpu-3"] and rows["gpu-3"].endswith("-")  # not joined yet


def test_token_rotate_writes_the_new_token_where_the_old_one_was_read(run, settings, tmp_path, monkeypatch):
    with session_factory(settings.resolved_database_url)() as session:
        _, old = create_user(session, "erin")
    token_file = tmp_path / ".trainyard" / "token"
    token_file.parent.mkdir()
    token_file.write_text(old + "\n")
    (tmp_path / "deeper").mkdir()
    monkeypatch.chdir(tmp_path / "deeper")  # found going up, as `trainyard up`'s token is

    code, out, err = run("token", "rotate")
    assert code == 0 and out == "" and f"written to {token_file}" in err, err
    new = token_file.read_text().strip()
    assert new != old and oct(token_file.stat().st_mode & 0o777) == "0o600"
    assert run("ls")[0] == 0
    assert run("ls", "--token", old)[0] == 1

    # From a config file: the file keeps its server and gets the new token.
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"server": Client().server, "token": new}))
    monkeypatch.setenv("TRAINYARD_CONFIG", str(config))
    token_file.unlink()
    assert run("token", "rotate")[0] == 0
    rotated = yaml.safe_load(config.read_text())
    assert rotated["server"] == Client().server and rotated["token"] not in (new, old)

    # From --token: printed, since there is nowhere to write it.
    code, out, _ = run("token", "rotate", "--token", rotated["token"])
    assert code == 0 and out.strip().startswith("ty_")


def test_usage_and_audit_print_tables(run, settings):
    with session_factory(settings.resolved_database_url)() as session:
        _, root = create_user(session, "root", is_admin=True)
        _, frank = create_user(session, "frank")
    with Client(token=frank) as client:
        job = client.submit(tiny_spec(name="franks-job"))
    code, out, _ = run("audit", "--token", root)
    assert code == 0 and "frank" in out and "POST /v1/jobs" in out and "submit gpt job" in out and str(job.id) in out
    code, _, err = run("audit", "--token", frank)
    assert code == 1 and "admins only" in err
    code, out, _ = run("usage", "--token", frank, "--since", "2026-01-01")
    assert code == 0 and "DEVICE-HOURS" in out
    code, _, err = run("usage", "--token", frank, "--since", "last week")
    assert code == 2 and "expected a time such as 2026-11-01" in err


def test_user_set_changes_an_existing_users_permissions_and_each_admin_command_is_audited(run, settings):
    assert run("user", "create", "gina")[0] == 0
    code, out, _ = run("user", "set", "gina", "--can-run-code")
    assert code == 0 and out.strip() == "gina: admin False, can_run_code True"
    assert run("user", "set", "gina", "--no-can-run-code", "--admin")[1].strip() == "gina: admin True, can_run_code False"
    code, _, err = run("user", "set", "gina")
    assert code == 1 and "nothing to set" in err
    code, _, err = run("user", "create", "gina")
    assert code == 1 and "already exists (`trainyard user set` changes its permissions)" in err
    assert run("user", "revoke", "gina")[0] == 0

    with session_factory(settings.resolved_database_url)() as session:
        _, root = create_user(session, "root", is_admin=True)
    with Client(token=root) as client:
        done = [(e.method, e.path) for e in client.audit()][::-1]
    assert done == [
        ("CLI", "trainyard user create gina"), ("CLI", "trainyard user set gina can_run_code=True"),
        ("CLI", "trainyard user set gina is_admin=True can_run_code=False"), ("CLI", "trainyard user revoke gina"),
    ]


def test_the_user_commands_find_the_embedded_database_going_up_or_say_where_they_looked(capsys, monkeypatch, tmp_path):
    from service.db.migrate import upgrade

    for name in ("TRAINYARD_DATABASE_URL", "TRAINYARD_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "yard" / ".trainyard").mkdir(parents=True)
    upgrade(f"sqlite:///{tmp_path}/yard/.trainyard/trainyard.db")
    (tmp_path / "yard" / ".trainyard" / "token").write_text("ty_admin\n")  # as `trainyard up` leaves it
    (tmp_path / "yard" / "examples" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "yard" / "examples" / "deeper")
    assert main(["user", "create", "hana"]) == 0 and capsys.readouterr().out.startswith("ty_")

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["user", "create", "ivan"]) == 1
    assert "error: no Trainyard database at" in capsys.readouterr().err  # one line, no traceback


def test_open_prints_a_one_time_link_that_signs_a_browser_in_without_the_token(run, settings, api_url, monkeypatch):
    with session_factory(settings.resolved_database_url)() as session:
        _, token = create_user(session, "fay")
    opened = []
    monkeypatch.setattr("webbrowser.open", opened.append)  # this machine has no browser to open
    code, out, err = run("open", "--token", token)
    link = out.strip()
    assert code == 0 and opened == [link] and "once" in err
    assert link.startswith(f"{api_url}/dashboard#login=") and token not in link
    assert run("open", "--no-browser", "--token", token)[0] == 0 and len(opened) == 1

    # What the page does with the link: the code from its fragment, for a session of its own.
    answer = httpx.post(f"{api_url}/v1/login", json={"code": link.rpartition("#login=")[2]})
    browser = answer.json()["token"]
    assert answer.status_code == 200 and browser != token
    with Client(server=api_url, token=browser) as as_browser:
        assert as_browser.submit(tiny_spec()).owner == "fay"
