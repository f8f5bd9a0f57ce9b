"""login_codes and browser_sessions: a one-time link signs a browser in (`trainyard open`)

Revision ID: 0021
Revises: 0020
"""
from alembic import op
import sqlalchemy as sa


revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'login_codes',
        sa.Column('code_hash', sa.String(64), primary_key=True),
        sa.Column('user_id', BIG_ID, sa.ForeignKey('users.id'), nullable=False, index=True),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('used_at', sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        'browser_sessions',
        sa.Column('id', BIG_ID, primary_key=True, autoincrement=True),
        sa.Column('user_id', BIG_ID, sa.ForeignKey('users.id'), nullable=False, index=True),
        sa.Column('token_hash', sa.String(64), nullable=False, unique=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('browser_sessions')
    op.drop_table('login_codes')
