"""Cluster pools (a Slurm partition that jobs name as `resources.pool`) and their attempts: what
one node of the pool offers, as its backend last read it, and each try's id and state in the
cluster. The attempts themselves change status only through state.py."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, contains_eager

from service.db import state
from service.db.dialect import dialect_insert
from service.db.models import Attempt, ClusterPool, utcnow

# The cluster states a try is left in once it is over on both sides: shown as they are, and no
# longer looked at by the pool's sync.
SETTLED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "VANISHED", "REFUSED")


def record_pool(session: Session, name: str, backend: str, info: dict) -> None:
    values = {"backend": backend, "info": info, "seen_at": utcnow()}
    insert = dialect_insert(session)(ClusterPool).values(name=name, **values)
    session.execute(insert.on_conflict_do_update(index_elements=["name"], set_=values))
    session.commit()


def forget_pool_if_moved(session: Session, name: str, partition: str) -> bool:
    """Drop the pool's description if it is of another partition than the one it is set to now (its
    backend could not describe the new one yet): a submit is told the pool isn't listed, rather than
    checked against the old partition's nodes and refused later by the cluster. Whether it was."""
    pool = session.get(ClusterPool, name)
    if pool is None or pool.info.get("partition") == partition:
        return False
    session.delete(pool)
    session.commit()
    return True


def all_pools(session: Session) -> list[ClusterPool]:
    return list(session.scalars(select(ClusterPool).order_by(ClusterPool.name)))


def pool_named(session: Session, name: str) -> ClusterPool | None:
    return session.get(ClusterPool, name)


def slot_capacity(pool: ClusterPool | None, device: str) -> int | None:
    """How many process slots of `device` the pool has in all (its nodes' CPUs, or GPUs), as its
    backend last read it; None until it has been read."""
    if pool is None:
        return None
    per_node = pool.info.get("gpus_per_node" if device == "cuda" else "cpus_per_node", 0)
    return pool.info.get("nodes", 0) * per_node


def unsettled_attempts(session: Session, pool: str, since: timedelta = timedelta(days=1)) -> list[Attempt]:
    """The pool's attempts that are active, or ended but whose cluster job has not been seen over
    yet (its allocation may still hold nodes, its token still open), with their jobs; oldest first."""
    query = (
        select(Attempt).join(Attempt.job).options(contains_eager(Attempt.job))
        .where(Attempt.pool == pool, Attempt.created_at >= utcnow() - since)
        .where(or_(Attempt.status.in_(state.ACTIVE_ATTEMPT), Attempt.cluster_state.is_(None), Attempt.cluster_state.not_in(SETTLED)))
        .order_by(Attempt.id)
    )
    return list(session.scalars(query))


def set_cluster_state(session: Session, attempt_ids: Iterable[int], cluster_state: str, cluster_job_id: str | None = None) -> None:
    """Record the try's id (once handed over) and state in its cluster; committed."""
    values: dict = {"cluster_state": cluster_state[:200]}
    if cluster_job_id is not None:
        values["cluster_job_id"] = cluster_job_id
    session.execute(update(Attempt).where(Attempt.id.in_(list(attempt_ids))).values(**values))
    session.commit()

