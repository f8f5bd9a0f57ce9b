from alembic import context

from service.db.models import Base

config = context.config
connectable = config.attributes.get("connection")


def run_migrations(connection) -> None:
    # SQLite alters a table by copying it, dropping the old one and renaming the copy ("batch"
    # mode): with foreign keys enforced, dropping a table that other rows reference fails. The
    # pragma only takes effect outside a transaction, so it is set on the raw connection first,
    # and every reference is checked once the migrations are done.
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()
        if sqlite and (broken := connection.exec_driver_sql("PRAGMA foreign_key_check").all()):
            raise RuntimeError(f"the migration left rows referencing nothing: {broken[:5]}")
    if sqlite:
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")


if connectable is not None:
    run_migrations(connectable)
else:
    from service.db.session import make_engine

    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as connection:
            run_migrations(connection)
    finally:
        engine.dispose()  # no connection left open: a migrated database can be copied (CREATE DATABASE ... TEMPLATE) or dropped
