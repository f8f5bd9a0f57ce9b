"""The output lines of a job's processes: stored once each, read as a tail or page by page after a cursor."""

from __future__ import annotations

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from service.db.attempts import HeldAttempt
from service.db.dialect import dialect_insert
from service.db.doorbell import tell_followers
from service.db.models import LogLine


# Rows per INSERT: 6 parameters a row, and PostgreSQL takes at most 65,535 in one statement (a burst
# of 11,000 lines in one INSERT failed, and was retried for ever).
ROWS_PER_INSERT = 2000


def record_logs(session: Session, job_id: int, attempt: HeldAttempt, lines: list[tuple[int, int | None, str]]) -> None:
    """Store (seq, rank, line) triples of an attempt's output, any number of them; re-sent lines are ignored."""
    if not lines:
        return
    lock_job_logs(session, job_id)
    insert = dialect_insert(session)
    rows = [
        # PostgreSQL's text holds no NUL (a line with one would be refused, with the whole batch, every time).
        {"job_id": job_id, "attempt_id": attempt.attempt_id, "attempt_number": attempt.number, "seq": seq, "rank": rank,
         "line": line.replace("\0", "\ufffd")}
        for seq, rank, line in lines
    ]
    for start in range(0, len(rows), ROWS_PER_INSERT):
        chunk = rows[start:start + ROWS_PER_INSERT]
        session.execute(insert(LogLine).values(chunk).on_conflict_do_nothing(index_elements=["attempt_id", "seq"]))
    tell_followers(session, job_id)
    session.commit()


def lock_job_logs(session: Session, job_id: int) -> None:
    """Make a job's log writers (the nodes of a gang) take turns until commit (PostgreSQL; SQLite
    writers already do): line ids are then handed out in commit order, so a reader that has seen
    line n never misses a line below n committed later (cursors and followed logs rely on it)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('trainyard-logs', :job_id))"), {"job_id": job_id})


def log_tail(session: Session, job_id: int, tail: int, rank: int | None = None) -> list[LogLine]:
    query = select(LogLine).where(LogLine.job_id == job_id).order_by(LogLine.id.desc()).limit(tail)
    if rank is not None:
        query = query.where(LogLine.rank == rank)
    return list(reversed(session.scalars(query).all()))


def log_lines_after(session: Session, job_id: int, after_id: int, limit: int, rank: int | None = None) -> list[LogLine]:
    """At most `limit` lines stored after line `after_id`, oldest first: one bounded page."""
    query = select(LogLine).where(LogLine.job_id == job_id, LogLine.id > after_id).order_by(LogLine.id).limit(limit)
    if rank is not None:
        query = query.where(LogLine.rank == rank)
    return list(session.scalars(query))


def last_log_line_id(session: Session, job_id: int) -> int:
    """The id of the job's latest stored log line; 0 before any."""
    return session.scalar(select(func.coalesce(func.max(LogLine.id), 0)).where(LogLine.job_id == job_id))
