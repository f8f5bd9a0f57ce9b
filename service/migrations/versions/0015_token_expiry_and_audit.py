"""tokens that expire and can be revoked; audit_entries: who did what, when, from where

Revision ID: 0015
Revises: 0014
"""
from alembic import op
import sqlalchemy as sa


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('users') as users:
        users.add_column(sa.Column('token_lifetime_s', sa.Integer(), nullable=True))
        users.add_column(sa.Column('token_expires_at', sa.DateTime(timezone=True), nullable=True))
        users.add_column(sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        'audit_entries',
        sa.Column('id', BigId, nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('user_id', BigId, nullable=True),
        sa.Column('user_name', sa.String(length=100), nullable=True),
        sa.Column('client_address', sa.String(length=100), nullable=False),
        sa.Column('method', sa.String(length=10), nullable=False),
        sa.Column('path', sa.String(length=500), nullable=False),
        sa.Column('status_code', sa.Integer(), nullable=False),
        sa.Column('job_id', BigId, nullable=True),
        sa.Column('detail', sa.String(length=500), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_audit_entries_at', 'audit_entries', ['at'])
    op.create_index('ix_audit_entries_user_id', 'audit_entries', ['user_id'])


def downgrade() -> None:
    op.drop_index('ix_audit_entries_user_id', table_name='audit_entries')
    op.drop_index('ix_audit_entries_at', table_name='audit_entries')
    op.drop_table('audit_entries')
    with op.batch_alter_table('users') as users:
        users.drop_column('revoked_at')
        users.drop_column('token_expires_at')
        users.drop_column('token_lifetime_s')
