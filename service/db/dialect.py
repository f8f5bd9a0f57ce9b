"""What the two databases spell differently: the INSERT with ON CONFLICT, and array parameters for PostgreSQL."""

from __future__ import annotations

from sqlalchemy.orm import Session


def dialect_insert(session: Session):
    """The dialect's INSERT, which has ON CONFLICT support on both SQLite and PostgreSQL."""
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def pg_array(items: list[int | float | str | None]) -> str:
    """A PostgreSQL array literal of numbers (None is NULL) or of strings, for `CAST(:param AS type[])`.

    psycopg dumps a list parameter element by element in Python, a regex per string: for a
    metrics batch that cost more than the statement itself. Floats are finite here (record_metrics
    stores NaN and infinity as None); repr keeps every bit of them."""
    if not items or not isinstance(items[0], str):  # a column of numbers (None among them)
        return "{" + ",".join(map(repr, items)).replace("None", "NULL") + "}"
    quoted = {name: '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"' for name in set(items)}  # a few names, repeated
    return "{" + ",".join(map(quoted.__getitem__, items)) + "}"
