"""A checkpoint is one stored directory, not one step: a script's two folders with one step are two
checkpoints, so the unique key is (job_id, path)

Revision ID: 0011
Revises: 0010
"""
from alembic import op


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('checkpoints') as table:
        table.drop_constraint('uq_checkpoints_job_step', type_='unique')
        table.create_unique_constraint('uq_checkpoints_job_path', ['job_id', 'path'])


def downgrade() -> None:
    with op.batch_alter_table('checkpoints') as table:
        table.drop_constraint('uq_checkpoints_job_path', type_='unique')
        table.create_unique_constraint('uq_checkpoints_job_step', ['job_id', 'step'])
