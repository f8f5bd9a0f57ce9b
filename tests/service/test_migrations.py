"""An installation made by an older release upgrades in place, its rows kept."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command

from service.db.migrate import alembic_config, upgrade


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
