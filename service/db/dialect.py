"""What the two databases spell differently: the INSERT with ON CONFLICT, and array parameters for PostgreSQL."""

from __future__ import annotations

from sqlalchemy import ColumnElement, String, bindparam, cast, func, select
from sqlalchemy.dialects.postgresql import ARRAY
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


def is_postgresql(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def one_of(column, param: str, postgresql: bool) -> ColumnElement[bool]:
    """`column IN (:param…)`, the list given by `list_param`. On PostgreSQL `IN (SELECT
    unnest(array))`: one parameter however long the list, so the statement's text stays the same
    and psycopg converts it once (a statement of 1,000 placeholders it converted afresh each time,
    a tenth of a scheduler pass over a large backlog). A subquery, not `= ANY(array)`, whose
    generic plan compared each row with each element."""
    if postgresql:
        return column.in_(_unnested(column, param))
    return column.in_(bindparam(param, expanding=True))


def none_of(column, param: str, postgresql: bool) -> ColumnElement[bool]:
    """`column NOT IN (:param…)`, as `one_of` (a hashed subquery on PostgreSQL)."""
    if postgresql:
        return column.not_in(_unnested(column, param))
    return column.not_in(bindparam(param, expanding=True))


def _unnested(column, param: str):
    return select(func.unnest(cast(bindparam(param, type_=String), ARRAY(column.type)))).scalar_subquery()


def list_param(values: list, postgresql: bool):
    """A list parameter for `one_of`."""
    return pg_array(values) if postgresql else values
