"""jobs.queued_at: when a job was last queued again, from which an elastic job's wait is counted

Revision ID: 0016
Revises: 0015
"""
from alembic import op
import sqlalchemy as sa


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as jobs:
        jobs.add_column(sa.Column('queued_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as jobs:
        jobs.drop_column('queued_at')
