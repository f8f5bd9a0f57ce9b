"""multi-node gang attempts: one attempt row per node of a try, and host addresses for rendezvous;
metric values nullable (NaN and infinity are stored as NULL); GPU indices per attempt; why a job
waits; preemption requests; the rank of each log line

Revision ID: 0003
Revises: 0002
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('node_rank', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('rendezvous', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('device_ids', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('preempt_requested', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.drop_constraint('uq_attempts_job_number', type_='unique')
        batch_op.create_unique_constraint('uq_attempts_job_number_node', ['job_id', 'number', 'node_rank'])
    with op.batch_alter_table('worker_hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('address', sa.String(length=200), nullable=False, server_default='127.0.0.1'))
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.alter_column('value', existing_type=sa.Float(), nullable=True)
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('waiting_reason', sa.String(length=500), nullable=True))
    with op.batch_alter_table('log_lines', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rank', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('log_lines', schema=None) as batch_op:
        batch_op.drop_column('rank')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('waiting_reason')
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.alter_column('value', existing_type=sa.Float(), nullable=False)
    with op.batch_alter_table('worker_hosts', schema=None) as batch_op:
        batch_op.drop_column('address')
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_constraint('uq_attempts_job_number_node', type_='unique')
        batch_op.create_unique_constraint('uq_attempts_job_number', ['job_id', 'number'])
        batch_op.drop_column('preempt_requested')
        batch_op.drop_column('device_ids')
        batch_op.drop_column('rendezvous')
        batch_op.drop_column('node_rank')
