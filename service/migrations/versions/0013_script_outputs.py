"""job_outputs: the directories a script job wrote (`script.outputs`), one row per job and name, latest collection wins

Revision ID: 0013
Revises: 0011
"""
from alembic import op
import sqlalchemy as sa


revision = '0013'
down_revision = '0011'
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'job_outputs',
        sa.Column('id', BigId, nullable=False),
        sa.Column('job_id', BigId, nullable=False),
        sa.Column('attempt_id', BigId, nullable=False),
        sa.Column('name', sa.String(length=1024), nullable=False),
        sa.Column('step', sa.Integer(), nullable=True),
        sa.Column('path', sa.String(length=1200), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('size_bytes', sa.BigInteger(), nullable=False),
        sa.Column('files', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('job_id', 'name', name='uq_job_outputs_job_name'),
    )
    op.create_index('ix_job_outputs_job_id', 'job_outputs', ['job_id'])


def downgrade() -> None:
    op.drop_index('ix_job_outputs_job_id', table_name='job_outputs')
    op.drop_table('job_outputs')
