"""An installation made by an older release upgrades in place, its rows kept."""

from __future__ import annotations

import json
import os

import sqlalchemy as sa
from alembic import command

from api_schemas import JobSpec
from service.db.migrate import alembic_config, upgrade
from tests.helpers import spec_dict
from trainyard.cli import main


def test_a_database_with_users_and_jobs_upgrades_from_0003_to_head(empty_database_url):
    # 0005 rebuilds the users table (SQLite: copy, drop, rename), which jobs reference: with
    # foreign keys enforced, SQLite refused the DROP once a user had a job.
    command.upgrade(alembic_config(empty_database_url), "0003")
    engine = sa.create_engine(empty_database_url)
    with engine.begin() as connection:
        connection.execute(sa.text(
            "INSERT INTO users (id, name, token_hash, is_admin, created_at) VALUES (1, 'alice', 'x', false, CURRENT_TIMESTAMP)"
        ))
        connection.execute(sa.text(
            "INSERT INTO jobs (id, owner_id, name, spec, status, priority, max_steps, step, restarts, cancel_requested, created_at)"
            " VALUES (7, 1, 'job', '{}', 'succeeded', 0, 10, 10, 0, false, CURRENT_TIMESTAMP)"
        ))
    engine.dispose()

    upgrade(empty_database_url)

    engine = sa.create_engine(empty_database_url)
    with engine.connect() as connection:
        assert connection.execute(sa.text("SELECT name, can_run_code FROM users")).all() == [("alice", False)]
        assert connection.execute(sa.text("SELECT id, owner_id FROM jobs")).all() == [(7, 1)]
    engine.dispose()


def test_gpt_specs_stored_before_the_untied_default_keep_their_tied_head(empty_database_url):
    # A job queued (or to resume) and a sweep's base written when every gpt had a tied head: read
    # with today's default they would build an untied one, which their checkpoints don't fit.
    command.upgrade(alembic_config(empty_database_url), "0019")
    old_gpt = {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "dropout": 0.0, "bias": False}
    engine = sa.create_engine(empty_database_url)
    specs = {
        1: {"name": "old", "model": old_gpt},
        2: {"name": "classifier", "model": {"kind": "mlp", "num_labels": 2}},
        3: {"name": "script", "script": {"command": "train.py"}},
    }
    with engine.begin() as connection:
        connection.execute(sa.text(
            "INSERT INTO users (id, name, token_hash, is_admin, can_run_code, created_at) VALUES (1, 'alice', 'x', false, false, CURRENT_TIMESTAMP)"
        ))
        for job_id, spec in specs.items():
            connection.execute(
                sa.text(
                    "INSERT INTO jobs (id, owner_id, name, spec, status, priority, max_steps, step, restarts, cancel_requested, created_at)"
                    " VALUES (:id, 1, 'job', :spec, 'queued', 0, 10, 0, 0, false, CURRENT_TIMESTAMP)"
                ),
                {"id": job_id, "spec": json.dumps(spec)},
            )
        connection.execute(
            sa.text("INSERT INTO sweeps (id, owner_id, name, spec, status, created_at) VALUES (1, 1, 's', :spec, 'running', CURRENT_TIMESTAMP)"),
            {"spec": json.dumps({"name": "s", "base": {"name": "b", "model": old_gpt}})},
        )
    engine.dispose()

    upgrade(empty_database_url)

    engine = sa.create_engine(empty_database_url)
    with engine.connect() as connection:
        stored = {row[0]: json.loads(row[1]) if isinstance(row[1], str) else row[1] for row in connection.execute(sa.text("SELECT id, spec FROM jobs"))}
        sweep = connection.execute(sa.text("SELECT spec FROM sweeps")).scalar_one()
    engine.dispose()
    tied = {**old_gpt, "tie_embeddings": True, "init": "gpt2"}
    assert stored[1]["model"] == tied
    assert stored[2] == specs[2] and stored[3] == specs[3]
    assert (json.loads(sweep) if isinstance(sweep, str) else sweep)["base"]["model"] == tied
    # What a job submits now says what it asks for, and is read as it says.
    assert JobSpec.model_validate(spec_dict()).model.tie_embeddings is False


def test_db_upgrade_says_what_it_did(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", f"sqlite:///{tmp_path / 'fresh.db'}")
    umask = os.umask(0o022)  # the server commands set 077 for what they write: not for the rest of this process
    try:
        assert main(["db", "upgrade"]) == 0
        first = capsys.readouterr().out.strip()
        assert first.startswith("database schema migrated from an empty database to revision "), first
        assert main(["db", "upgrade"]) == 0
        assert capsys.readouterr().out.strip() == f"database schema is up to date (revision {first.rpartition(' ')[2]})"
    finally:
        os.umask(umask)


def test_the_server_commands_on_a_database_not_migrated_say_to_run_db_upgrade_and_start_nothing(empty_database_url, monkeypatch, capsys):
    """The API started on an empty database answered /healthz and 500 to every request; `user create`
    and the scheduler printed tracebacks (the scheduler every pass)."""
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", empty_database_url)
    umask = os.umask(0o022)
    try:
        for argv, code in ((["api", "--port", "1"], 2), (["scheduler"], 2), (["user", "create", "bob"], 1)):
            assert main(argv) == code, argv
            said = capsys.readouterr().err
            assert "has no Trainyard tables: run `trainyard db upgrade`" in said and "Traceback" not in said, said
        command.upgrade(alembic_config(empty_database_url), "0003")  # an older release's
        assert main(["user", "create", "bob"]) == 1
        assert "is at schema revision 0003, older than this release's" in capsys.readouterr().err
        # One that can't be opened: which, and why, in a line (a password not shown).
        monkeypatch.setenv("TRAINYARD_DATABASE_URL", "postgresql+psycopg://trainyard:secret@127.0.0.1:1/nowhere")
        assert main(["api", "--port", "1"]) == 2
        said = capsys.readouterr().err
        assert said.startswith("error: cannot open the database at postgresql+psycopg://trainyard:***@127.0.0.1:1/nowhere (")
        assert "secret" not in said and "check TRAINYARD_DATABASE_URL" in said
    finally:
        os.umask(umask)


def test_a_misspelt_setting_is_named_with_the_one_meant(tmp_path, monkeypatch, capsys):
    """TRAINYARD_DB_URL was ignored in silence: the API ran on a SQLite file of its own."""
    monkeypatch.setenv("TRAINYARD_DB_URL", "postgresql+psycopg://db/trainyard")
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", f"sqlite:///{tmp_path / 'missing' / 'trainyard.db'}")
    umask = os.umask(0o022)
    try:
        assert main(["db", "upgrade"]) == 2
    finally:
        os.umask(umask)
    said = capsys.readouterr().err
    assert "trainyard: warning: TRAINYARD_DB_URL is no setting of Trainyard's, ignored (did you mean TRAINYARD_DATABASE_URL?)" in said
    assert "error: cannot open the database at sqlite:///" in said and "Traceback" not in said
