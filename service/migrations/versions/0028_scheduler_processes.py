"""scheduler_processes: each scheduler notes its passes, so the API can say when none runs

Revision ID: 0028
Revises: 0027
"""
from alembic import op
import sqlalchemy as sa


revision = '0028'
down_revision = '0027'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'scheduler_processes',
        sa.Column('name', sa.String(200), primary_key=True),
        sa.Column('seen_at', sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('scheduler_processes')
