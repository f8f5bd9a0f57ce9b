from alembic import context

from service.db.models import Base

config = context.config
connectable = config.attributes.get("connection")


def run_migrations(connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


if connectable is not None:
    run_migrations(connectable)
else:
    from service.db.session import make_engine

    with make_engine(config.get_main_option("sqlalchemy.url")).connect() as connection:
        run_migrations(connection)
