"""sweeps: a hyperparameter search, its trials jobs with a sweep_id and a trial number (unique per sweep)

Revision ID: 0010
Revises: 0007
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0007'
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'sweeps',
        sa.Column('id', BigId, nullable=False),
        sa.Column('owner_id', BigId, nullable=False),
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('spec', sa.JSON(), nullable=False),
        sa.Column('status', sa.Enum('running', 'succeeded', 'failed', 'cancelled', name='sweepstatus', native_enum=False, length=16), nullable=False),
        sa.Column('failure_reason', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['owner_id'], ['users.id']),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_sweeps_owner_id', 'sweeps', ['owner_id'])
    op.create_index('ix_sweeps_status', 'sweeps', ['status'])
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sweep_id', BigId, nullable=True))
        batch_op.add_column(sa.Column('trial_number', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('trial', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('prune_reason', sa.Text(), nullable=True))
        batch_op.create_foreign_key('fk_jobs_sweep_id', 'sweeps', ['sweep_id'], ['id'])
        batch_op.create_unique_constraint('uq_jobs_sweep_trial', ['sweep_id', 'trial_number'])


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_constraint('uq_jobs_sweep_trial', type_='unique')
        batch_op.drop_constraint('fk_jobs_sweep_id', type_='foreignkey')
        batch_op.drop_column('prune_reason')
        batch_op.drop_column('trial')
        batch_op.drop_column('trial_number')
        batch_op.drop_column('sweep_id')
    op.drop_index('ix_sweeps_status', table_name='sweeps')
    op.drop_index('ix_sweeps_owner_id', table_name='sweeps')
    op.drop_table('sweeps')
