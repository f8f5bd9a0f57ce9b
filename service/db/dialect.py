"""What the two databases spell differently: the INSERT with ON CONFLICT, array parameters and
pipelined statements for PostgreSQL."""

from __future__ import annotations

import functools

from sqlalchemy import ColumnElement, String, TextClause, bindparam, cast, func, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

Statement = tuple[TextClause, dict]  # a statement and its parameters, for `pipelined`


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


def pipelined(session: Session, statements: list[Statement]) -> None:
    """On PostgreSQL: run `statements` in order in the session's transaction, sent together in one
    round trip (psycopg's pipeline mode), each seeing what the ones before it wrote. None's result
    is read: they are writes. A metrics batch is seven (service/db/metrics.py); one by one through
    SQLAlchemy, each was a round trip and a sixth of a million of the API's instructions."""
    connection = session.connection().connection.driver_connection
    with connection.pipeline(), connection.cursor() as cursor:
        for statement, parameters in statements:
            cursor.execute(_psycopg_text(statement), parameters)


@functools.cache  # they are module constants
def _psycopg_text(statement: TextClause) -> str:
    """The statement as psycopg takes it: `%(name)s` for each `:name`."""
    return str(statement.compile(dialect=postgresql.psycopg.dialect()))
