"""The data layer: the tables, the status state machine, and every query and commit of the service.

Routes, the scheduler and the workers check what they must and call the functions of these
modules, one module per resource: accounts, uploads, jobs, attempts (the worker's side), hosts,
scheduling (the scheduler's pass), metrics with metric_buckets, log_lines, checkpoints, and
monitoring (the dashboard's counts and GET /metrics). Job and attempt statuses change only
through state.py.

The layering rule (tests/unit/test_boundaries.py checks it): a module of service/db imports the
project's api_schemas and other modules of service/db, nothing else of the project. Whatever sits
above (service.api, service.scheduler, the workers, the CLI) may import the data layer, never the
other way round. Migrations (service/migrations/versions) import no project code at all: each
says what the schema and data were at its revision, however the live code changes later.

The statements on the path of every job's start (the scheduler's pass, the worker's claim) are
built once, as `_UPPER_CASE` constants with bind parameters: building a SQLAlchemy statement takes
more CPU than the database takes to run one of these (bench/dispatch_latency.py).
"""
