"""deleted_checkpoints: the checkpoints keep_last deleted, so their download answers why

Revision ID: 0014
Revises: 0013
"""
from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'deleted_checkpoints',
        sa.Column('id', BigId, nullable=False),
        sa.Column('job_id', BigId, nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id']),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_deleted_checkpoints_job_id', 'deleted_checkpoints', ['job_id'])


def downgrade() -> None:
    op.drop_index('ix_deleted_checkpoints_job_id', table_name='deleted_checkpoints')
    op.drop_table('deleted_checkpoints')
