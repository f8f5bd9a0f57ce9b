"""worker_hosts.net_index, attempts.net_address: a network of its own for each gang's attempt

Revision ID: 0025
Revises: 0024
"""
from alembic import op
import sqlalchemy as sa


revision = '0025'
down_revision = '0024'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('worker_hosts') as batch_op:
        batch_op.add_column(sa.Column('net_index', sa.Integer(), nullable=True))
        batch_op.create_unique_constraint('uq_worker_hosts_net_index', ['net_index'])
    with op.batch_alter_table('attempts') as batch_op:
        batch_op.add_column(sa.Column('net_address', sa.String(length=45), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts') as batch_op:
        batch_op.drop_column('net_address')
    with op.batch_alter_table('worker_hosts') as batch_op:
        batch_op.drop_constraint('uq_worker_hosts_net_index', type_='unique')
        batch_op.drop_column('net_index')
