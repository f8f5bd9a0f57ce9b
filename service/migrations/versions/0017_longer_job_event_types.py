"""job_events.type: 32 characters, for `checkpoint_refused` and `output_refused`

Revision ID: 0017
Revises: 0016
"""
from alembic import op
import sqlalchemy as sa


revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('job_events') as events:
        events.alter_column('type', existing_type=sa.String(16), type_=sa.String(32), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('job_events') as events:
        events.alter_column('type', existing_type=sa.String(32), type_=sa.String(16), existing_nullable=False)
