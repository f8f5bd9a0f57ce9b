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
    # The summaries of the metrics stored before this revision, job by job.
    from sqlalchemy.orm import Session

    from service.db import crud

    session = Session(bind=op.get_bind())
    for (job_id,) in session.execute(sa.text("SELECT DISTINCT job_id FROM metrics")).all():
        crud.refresh_metric_buckets(session, job_id)


def downgrade() -> None:
    op.drop_table('metric_buckets')
