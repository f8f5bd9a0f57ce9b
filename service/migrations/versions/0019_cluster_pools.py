"""cluster pools: a Slurm partition as a pool jobs may name, and each attempt's id and state in it

Revision ID: 0019
Revises: 0018
"""
from alembic import op
import sqlalchemy as sa


revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'cluster_pools',
        sa.Column('name', sa.String(40), primary_key=True),
        sa.Column('backend', sa.String(16), nullable=False),
        sa.Column('info', sa.JSON(), nullable=False),
        sa.Column('seen_at', sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table('attempts') as batch:
        batch.add_column(sa.Column('pool', sa.String(40), nullable=True))
        batch.add_column(sa.Column('cluster_job_id', sa.String(64), nullable=True))
        batch.add_column(sa.Column('cluster_state', sa.String(200), nullable=True))
    op.create_index('ix_attempts_pool', 'attempts', ['pool'])  # each sync reads the pool's unsettled attempts


def downgrade() -> None:
    op.drop_index('ix_attempts_pool', 'attempts')
    with op.batch_alter_table('attempts') as batch:
        batch.drop_column('cluster_state')
        batch.drop_column('cluster_job_id')
        batch.drop_column('pool')
    op.drop_table('cluster_pools')
