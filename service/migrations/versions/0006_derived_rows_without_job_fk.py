"""job_events and metric_buckets without a foreign key to jobs: each of their writes already finds
the job row (the event counter's UPDATE … RETURNING fails without it; buckets are made of metrics,
which keep their key) and jobs are never deleted, so the per-row check guarded nothing and cost a
metrics batch ~2 ms (300 events and ~130 new buckets checked one by one)

Revision ID: 0006
Revises: 0005
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

TABLES = ('job_events', 'metric_buckets')
# Keys SQLite made without a name get this one when batch mode reflects the table.
UNNAMED = {'fk': 'fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s'}


def upgrade() -> None:
    for table in TABLES:
        [key] = [key for key in sa.inspect(op.get_bind()).get_foreign_keys(table) if key['referred_table'] == 'jobs']
        with op.batch_alter_table(table, naming_convention=UNNAMED) as batch_op:
            batch_op.drop_constraint(key['name'] or f'fk_{table}_job_id_jobs', type_='foreignkey')


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch_op:
            batch_op.create_foreign_key(f'{table}_job_id_fkey', 'jobs', ['job_id'], ['id'])
