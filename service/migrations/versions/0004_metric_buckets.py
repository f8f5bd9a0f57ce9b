"""metric_buckets: per-series summaries (min, max, last, first NaN) of buckets of 16, 256, 4,096 and
65,536 steps, so that a chart of a million-point series reads a few thousand rows; built here for
the metrics already stored

Revision ID: 0004
Revises: 0003
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'metric_buckets',
        sa.Column('job_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('level', sa.Integer(), nullable=False),
        sa.Column('bucket', sa.Integer(), nullable=False),
        sa.Column('count', sa.Integer(), nullable=False),
        sa.Column('first_step', sa.Integer(), nullable=False),
        sa.Column('min_step', sa.Integer(), nullable=True),
        sa.Column('min_value', sa.Float(), nullable=True),
        sa.Column('max_step', sa.Integer(), nullable=True),
        sa.Column('max_value', sa.Float(), nullable=True),
        sa.Column('last_step', sa.Integer(), nullable=False),
        sa.Column('last_value', sa.Float(), nullable=True),
        sa.Column('null_step', sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id']),
        sa.PrimaryKeyConstraint('job_id', 'name', 'level', 'bucket'),
    )
    # The summaries of the metrics stored before this revision, job by job. Written out here, not
    # taken from the live code, so this step stays what it was at this revision.
    connection = op.get_bind()
    buckets = sa.table('metric_buckets', *(sa.column(name) for name in _BUCKET_COLUMNS))
    for (job_id,) in connection.execute(sa.text("SELECT DISTINCT job_id FROM metrics")).all():
        series: dict[str, list[tuple[int, float | None]]] = {}
        query = sa.text("SELECT name, step, value FROM metrics WHERE job_id = :job_id ORDER BY name, step")
        for name, step, value in connection.execute(query, {"job_id": job_id}):
            series.setdefault(name, []).append((step, value))
        rows = [
            {"job_id": job_id, "name": name, "level": level, "bucket": bucket, **_summary(bucket_points)}
            for name, points in series.items()
            for level in (1, 2, 3, 4)
            for bucket, bucket_points in _in_buckets(points, 16**level).items()
        ]
        if rows:
            connection.execute(buckets.insert(), rows)


_BUCKET_COLUMNS = ['job_id', 'name', 'level', 'bucket', 'count', 'first_step', 'min_step', 'min_value',
                   'max_step', 'max_value', 'last_step', 'last_value', 'null_step']


def _in_buckets(points: list[tuple[int, float | None]], width: int) -> dict[int, list[tuple[int, float | None]]]:
    """(step, value) points in step order, grouped by bucket of `width` steps."""
    buckets: dict[int, list[tuple[int, float | None]]] = {}
    for step, value in points:
        buckets.setdefault(step // width, []).append((step, value))
    return buckets


def _summary(points: list[tuple[int, float | None]]) -> dict:
    """A bucket's summary as the service kept it at this revision: the lowest and highest value
    (ties to the earlier step), the last one, and the first NaN (None) step."""
    finite = [(value, step) for step, value in points if value is not None]
    low, high = (min(finite), max(finite, key=lambda p: (p[0], -p[1]))) if finite else ((None, None), (None, None))
    return {
        "count": len(points), "first_step": points[0][0],
        "min_step": low[1], "min_value": low[0], "max_step": high[1], "max_value": high[0],
        "last_step": points[-1][0], "last_value": points[-1][1],
        "null_step": next((step for step, value in points if value is None), None),
    }


def downgrade() -> None:
    op.drop_table('metric_buckets')
