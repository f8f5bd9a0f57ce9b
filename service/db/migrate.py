"""Schema migrations with Alembic: `trainyard db upgrade` (and `trainyard up`) run `upgrade`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str) -> tuple[str | None, str]:
    """Migrate to the newest schema; (the revision it was at, None for an empty database; the one it is at now)."""
    config = alembic_config(database_url)
    before = current_revision(database_url)
    command.upgrade(config, "head")
    return before, current_revision(database_url)


def current_revision(database_url: str) -> str | None:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
