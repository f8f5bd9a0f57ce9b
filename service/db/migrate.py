"""Schema migrations with Alembic: `trainyard db upgrade` (and `trainyard up`) run `upgrade`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

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


class SchemaNotReady(Exception):
    """The database can't be opened, or is not at this release's schema; the message says what to do."""


def check_schema(database_url: str) -> None:
    """Raises SchemaNotReady unless the database opens and is at this release's newest revision. The
    API started on an empty database answered /healthz and then 500 to every request; a misspelt
    database setting, a traceback of the SQLite file it fell back to."""
    shown = make_url(database_url).render_as_string(hide_password=True)
    try:
        current = current_revision(database_url)
    except SQLAlchemyError as exc:
        reason = str(exc.orig if getattr(exc, "orig", None) is not None else exc).splitlines()[0]
        raise SchemaNotReady(f"cannot open the database at {shown} ({reason}): check TRAINYARD_DATABASE_URL") from exc
    script = ScriptDirectory.from_config(alembic_config(database_url))
    head = script.get_current_head()
    if current == head:
        return
    if current is None:
        what = "has no Trainyard tables"
    elif current not in {revision.revision for revision in script.walk_revisions()}:
        raise SchemaNotReady(f"the database at {shown} is at schema revision {current}, which this release does not know "
                             "(a newer release's): run that release")
    else:
        what = f"is at schema revision {current}, older than this release's {head}"
    raise SchemaNotReady(f"the database at {shown} {what}: run `trainyard db upgrade` (with the same TRAINYARD_DATABASE_URL) first")
