"""api_processes: each API process notes that it is up, so the scheduler judges leases only while
hosts could renew them

Revision ID: 0026
Revises: 0025
"""
from alembic import op
import sqlalchemy as sa


revision = '0026'
down_revision = '0025'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'api_processes',
        sa.Column('name', sa.String(200), primary_key=True),
        sa.Column('up_since', sa.DateTime(timezone=True), nullable=False),
        sa.Column('seen_at', sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('api_processes')
