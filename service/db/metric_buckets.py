"""The bucket summaries of metric series (service/db/rollups.py), kept up to date as points arrive."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import TextClause, select, text, union_all
from sqlalchemy.orm import Session

from service.db import rollups
from service.db.dialect import Statement, dialect_insert, pg_array, pipelined
from service.db.models import Metric, MetricBucket


def refresh_metric_buckets(session: Session, job_id: int, points: list[tuple[int, str, float | None]] | None = None) -> None:
    """Bring the bucket summaries of every level up to date with `points` (step, name, value) just
    stored, or rebuild all of the job's from its stored points when None. Not committed: part of
    the caller's write.

    Each touched bucket is made of what lies one level down: the batch's points or the buckets
    just recomputed, and the stored ones beside them (read in two statements)."""
    if points is not None and session.get_bind().dialect.name == "postgresql":
        return pipelined(session, bucket_statements(job_id, points))
    if points is None:
        points = session.execute(select(Metric.step, Metric.name, Metric.value).where(Metric.job_id == job_id)).all()
    values: dict[str, dict[int, float | None]] = {}  # name → step → value
    for step, name, value in points:
        values.setdefault(name, {})[step] = value
    names, fanout = sorted(values), rollups.FANOUT
    # The buckets the batch falls in, level by level: a bucket's parent is its number // fanout.
    touched: dict[int, dict[str, list[int]]] = {}
    keys: dict[str, Iterable[int]] = values  # steps, then the buckets of the level below
    for level in rollups.LEVELS:
        touched[level] = keys = {name: sorted({key // fanout for key in below}) for name, below in keys.items()}
    # The stored points of the level-1 buckets the batch covers only in part.
    partial = {
        (0, bucket * fanout, bucket * fanout + fanout - 1)
        for name, buckets in touched[1].items()
        for bucket in buckets
        if any(step not in values[name] for step in range(bucket * fanout, bucket * fanout + fanout))
    }
    if partial:
        # A UNION of one index range scan per run of buckets: under an OR, PostgreSQL pulls the
        # shared `job_id = … AND name IN …` out and scans every point of the job.
        per_range = [
            select(Metric.step, Metric.name, Metric.value).where(Metric.job_id == job_id, Metric.name.in_(names), Metric.step.between(low, high))
            for _, low, high in _coalesce(partial)
        ]
        for step, name, value in session.execute(union_all(*per_range)):
            values[name].setdefault(step, value)
    # The stored buckets one level below each touched bucket of level 2 and up.
    below = {(level - 1, bucket * fanout, bucket * fanout + fanout - 1) for level in rollups.LEVELS[1:] for buckets in touched[level].values() for bucket in buckets}
    finer: dict[int, dict[str, dict[int, rollups.Summary]]] = {level: {name: {} for name in names} for level in rollups.LEVELS}
    for name, level, bucket, summary in bucket_rows(session, job_id, names, below):
        finer[level][name][bucket] = summary

    rows = []
    for level in rollups.LEVELS:
        for name, buckets in touched[level].items():
            for bucket in buckets:
                keys = range(bucket * fanout, bucket * fanout + fanout)
                if level == 1:
                    summary = rollups.Summary.of_points([(step, values[name][step]) for step in keys if step in values[name]])
                else:
                    summary = rollups.merge([finer[level - 1][name][key] for key in keys if key in finer[level - 1][name]])
                finer[level][name][bucket] = summary  # what the level above is made of
                rows.append({"job_id": job_id, "name": name, "level": level, "bucket": bucket, **vars(summary)})
    _upsert_buckets(session, rows)


def bucket_statements(job_id: int, points: list[tuple[int, str, float | None]]) -> list[Statement]:
    """refresh_metric_buckets on PostgreSQL, as statements to run in order once the points are
    stored: each level's touched buckets recomputed by the server from the level below, one
    statement per level. The same summaries as rollups.Summary and rollups.merge
    (tests/service/test_metric_rollups.py compares them with a rebuild in Python), without carrying
    the stored neighbours to Python and back (10.8 → ~4 ms of a 2,100-point batch)."""
    keys, statements = {(name, step // rollups.FANOUT) for step, name, _ in points}, []
    for level in rollups.LEVELS:
        if level > 1:
            keys = {(name, bucket // rollups.FANOUT) for name, bucket in keys}  # a bucket's parent: its number // fanout
        names, buckets = zip(*keys)
        statements.append((_SUMMARISE_POINTS if level == 1 else _MERGE_BUCKETS, {
            "job_id": job_id, "level": level, "names": pg_array(list(names)), "buckets": pg_array(list(buckets)),
        }))
    return statements


def _upsert_buckets(session: Session, rows: list[dict]) -> None:
    if not rows:
        return
    if session.get_bind().dialect.name == "postgresql":
        # One statement of a column array each, as for the points (record_metrics).
        session.execute(_UPSERT_BUCKET_ARRAYS, {column: pg_array([row[column] for row in rows]) for column in _BUCKET_COLUMNS})
        return
    statement = dialect_insert(session)(MetricBucket)
    key, summary = _BUCKET_COLUMNS[:4], _BUCKET_COLUMNS[4:]
    session.execute(statement.on_conflict_do_update(index_elements=key, set_={c: statement.excluded[c] for c in summary}), rows)


_BUCKET_ARRAY_TYPES = {"job_id": "bigint", "name": "varchar", "min_value": "double precision", "max_value": "double precision", "last_value": "double precision"}
_BUCKET_COLUMNS = ["job_id", "name", "level", "bucket", *rollups.Summary.__dataclass_fields__]
_ON_BUCKET_CONFLICT = f"ON CONFLICT (job_id, name, level, bucket) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in _BUCKET_COLUMNS[4:])}"
_UPSERT_BUCKET_ARRAYS = text(f"""
    INSERT INTO metric_buckets ({", ".join(_BUCKET_COLUMNS)})
    SELECT * FROM unnest({", ".join(f"CAST(:{c} AS {_BUCKET_ARRAY_TYPES.get(c, 'integer')}[])" for c in _BUCKET_COLUMNS)})
    {_ON_BUCKET_CONFLICT}
""")


# Each touched bucket of a level summarised from what lies in it one level down. The summary is a
# LATERAL aggregate, so each bucket is one index range scan: as a plain join, the planner hashes
# every point of the job (143 ms at 128k points, growing with the run). The lowest, highest and last
# points are the min or max of [value, step] (of [step, value] for the last) arrays, which order
# as rollups does (ties to the earlier step) without sorting each bucket. A NaN is stored as NULL.
def _summarise_touched(below: str, key: str, summary: str) -> TextClause:
    """The upsert of a level's touched buckets (:names and :buckets), each summarised from the rows
    of `below` (points, or the buckets one level down) whose `key` falls in it."""
    scope = " AND level = :level - 1" if below == "metric_buckets" else ""
    return text(f"""
    INSERT INTO metric_buckets ({", ".join(_BUCKET_COLUMNS)})
    SELECT :job_id, touched.name, :level, touched.bucket, summary.count, summary.first_step,
           summary.low[2]::integer, summary.low[1], (-summary.high[2])::integer, summary.high[1],
           summary.last[1]::integer, summary.last[2], summary.null_step
    FROM unnest(CAST(:names AS varchar[]), CAST(:buckets AS integer[])) AS touched(name, bucket)
    CROSS JOIN LATERAL (SELECT {summary} FROM {below}
        WHERE job_id = :job_id AND name = touched.name{scope}
          AND {key} BETWEEN touched.bucket * {rollups.FANOUT} AND touched.bucket * {rollups.FANOUT} + {rollups.FANOUT - 1}) AS summary
    WHERE summary.count > 0
    {_ON_BUCKET_CONFLICT}
    """)


_SUMMARISE_POINTS = _summarise_touched("metrics", "step", """count(*) AS count, min(step) AS first_step,
    min(ARRAY[value, step]) FILTER (WHERE value IS NOT NULL) AS low,
    max(ARRAY[value, -step]) FILTER (WHERE value IS NOT NULL) AS high,
    max(ARRAY[step, value]) AS last, min(step) FILTER (WHERE value IS NULL) AS null_step""")
_MERGE_BUCKETS = _summarise_touched("metric_buckets", "bucket", """sum(count) AS count, min(first_step) AS first_step,
    min(ARRAY[min_value, min_step]) FILTER (WHERE min_step IS NOT NULL) AS low,
    max(ARRAY[max_value, -max_step]) FILTER (WHERE max_step IS NOT NULL) AS high,
    max(ARRAY[last_step, last_value]) AS last, min(null_step) AS null_step""")


def _coalesce(ranges: set[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(level, first, last) ranges with adjacent and overlapping ones of a level joined: a batch
    touches a run of buckets, which one BETWEEN covers."""
    joined: list[tuple[int, int, int]] = []
    for level, low, high in sorted(ranges):
        if joined and joined[-1][0] == level and low <= joined[-1][2] + 1:
            joined[-1] = (level, joined[-1][1], max(high, joined[-1][2]))
        else:
            joined.append((level, low, high))
    return joined


def bucket_rows(
    session: Session, job_id: int, names: list[str] | None, ranges: set[tuple[int, int, int]]
) -> list[tuple[str, int, int, rollups.Summary]]:
    """(name, level, bucket, summary) of the stored buckets in `ranges` of (level, first, last
    bucket), in name and bucket order."""
    if not ranges:
        return []
    # Plain rows, not ORM objects: a chart reads thousands of these per request.
    columns = [getattr(MetricBucket, field) for field in rollups.Summary.__dataclass_fields__]
    # One index range scan per run of buckets (see refresh_metric_buckets on OR and UNION).
    per_range = []
    for level, low, high in _coalesce(ranges):
        query = select(MetricBucket.name, MetricBucket.level, MetricBucket.bucket, *columns).where(
            MetricBucket.job_id == job_id, MetricBucket.level == level, MetricBucket.bucket.between(low, high)
        )
        per_range.append(query.where(MetricBucket.name.in_(names)) if names else query)
    rows = session.execute(union_all(*per_range).order_by("name", "level", "bucket")).all()  # one fetch, not one per row
    return [(name, level, bucket, rollups.Summary(*summary)) for name, level, bucket, *summary in rows]
