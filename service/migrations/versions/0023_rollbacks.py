"""jobs.rollbacks, jobs.rollback_skip: the loss guard's rollbacks

Revision ID: 0023
Revises: 0022
"""
from alembic import op
import sqlalchemy as sa


revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.add_column(sa.Column('rollbacks', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('rollback_skip', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.drop_column('rollback_skip')
        batch_op.drop_column('rollbacks')
