"""teams, team_members, fair_share_usage, jobs.team_id, attempts.preempt_reason: quotas and fair share per team

Revision ID: 0022
Revises: 0021
"""
from alembic import op
import sqlalchemy as sa


revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'teams',
        sa.Column('id', BIG_ID, primary_key=True, autoincrement=True),
        sa.Column('name', sa.String(100), nullable=False, unique=True),
        sa.Column('quota', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        'team_members',
        sa.Column('team_id', BIG_ID, sa.ForeignKey('teams.id'), primary_key=True),
        sa.Column('user_id', BIG_ID, sa.ForeignKey('users.id'), primary_key=True, index=True),
        sa.Column('is_default', sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.create_table(
        'fair_share_usage',
        sa.Column('id', sa.Integer(), primary_key=True),
        sa.Column('usage', sa.JSON(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.add_column(sa.Column('team_id', BIG_ID, sa.ForeignKey('teams.id', name='fk_jobs_team_id'), nullable=True))
        batch_op.create_index('ix_jobs_team_id', ['team_id'])
    with op.batch_alter_table('attempts') as batch_op:
        batch_op.add_column(sa.Column('preempt_reason', sa.String(300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts') as batch_op:
        batch_op.drop_column('preempt_reason')
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.drop_index('ix_jobs_team_id')
        batch_op.drop_constraint('fk_jobs_team_id', type_='foreignkey')
        batch_op.drop_column('team_id')
    op.drop_table('fair_share_usage')
    op.drop_table('team_members')
    op.drop_table('teams')
