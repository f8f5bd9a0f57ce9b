"""the built-in GPT's head is untied by default: stored specs say what they were built with

`model.tie_embeddings` and `model.init` are new fields of the gpt model. Before them every gpt job was
built with a tied head and GPT-2's init; the new default is an untied head. A stored spec without
the fields would now read as untied, so a queued job, a resumed attempt (its checkpoint holds no
separate head) or a sweep's next trial would build another model than the one it started with.
This writes the old values into every stored gpt spec that lacks them.

Revision ID: 0020
Revises: 0019
"""
from alembic import op
import sqlalchemy as sa


revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None

BEFORE = {'tie_embeddings': True, 'init': 'gpt2'}


def _with_old_model_fields(model: dict) -> dict | None:
    """The model dict with the fields it was built with, or None if it needs nothing."""
    if not isinstance(model, dict) or model.get('kind') != 'gpt' or all(key in model for key in BEFORE):
        return None
    return {**BEFORE, **model}


def upgrade() -> None:
    connection = op.get_bind()
    jobs = sa.table('jobs', sa.column('id', sa.Integer), sa.column('spec', sa.JSON))
    for job_id, spec in connection.execute(sa.select(jobs.c.id, jobs.c.spec)).all():
        if isinstance(spec, dict) and (model := _with_old_model_fields(spec.get('model'))) is not None:
            connection.execute(jobs.update().where(jobs.c.id == job_id).values(spec={**spec, 'model': model}))
    sweeps = sa.table('sweeps', sa.column('id', sa.Integer), sa.column('spec', sa.JSON))
    for sweep_id, spec in connection.execute(sa.select(sweeps.c.id, sweeps.c.spec)).all():
        base = spec.get('base') if isinstance(spec, dict) else None
        if isinstance(base, dict) and (model := _with_old_model_fields(base.get('model'))) is not None:
            connection.execute(sweeps.update().where(sweeps.c.id == sweep_id).values(spec={**spec, 'base': {**base, 'model': model}}))


def downgrade() -> None:
    pass  # the written fields are the old code's defaults: it reads them as before
