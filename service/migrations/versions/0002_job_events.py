"""job events: the log behind GET /v1/jobs/{id}/events

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 08:20:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Jobs that exist already start their event log at 1.
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('last_event_seq', sa.Integer(), server_default='0', nullable=False))

    op.create_table('job_events',
    sa.Column('job_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('type', sa.Enum('status', 'metrics', 'checkpoint', name='jobeventtype', native_enum=False, length=16), nullable=False),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('job_id', 'seq')
    )


def downgrade() -> None:
    op.drop_table('job_events')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('last_event_seq')
