"""attempts.run_environment: what each attempt ran with, for a job's run record

Revision ID: 0024
Revises: 0023
"""
from alembic import op
import sqlalchemy as sa


revision = '0024'
down_revision = '0023'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('attempts') as batch_op:
        batch_op.add_column(sa.Column('run_environment', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts') as batch_op:
        batch_op.drop_column('run_environment')
