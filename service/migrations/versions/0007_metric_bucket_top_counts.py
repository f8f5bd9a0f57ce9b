"""ix_metric_buckets_top_counts: the counts of the coarsest bucket summaries in a partial index, so
that the total of points stored (/metrics) is added up from a row per series and 65,536 steps
instead of counting every point at each scrape

Revision ID: 0007
Revises: 0006
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

TOP_LEVEL = sa.text('level = 4')


def upgrade() -> None:
    op.create_index('ix_metric_buckets_top_counts', 'metric_buckets', ['count'], postgresql_where=TOP_LEVEL, sqlite_where=TOP_LEVEL)


def downgrade() -> None:
    op.drop_index('ix_metric_buckets_top_counts', table_name='metric_buckets')
