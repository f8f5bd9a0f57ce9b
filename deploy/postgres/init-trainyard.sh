#!/bin/sh
# Run once by the postgres image on an empty data directory (/docker-entrypoint-initdb.d): the
# service's own role owns its database and nothing else. Not a superuser: a job that reached the
# database (it must not: workers/egress.py) could then only touch Trainyard's tables, not the server.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
     -v password="$TRAINYARD_DB_PASSWORD" <<'SQL'
CREATE ROLE trainyard LOGIN PASSWORD :'password' NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION;
CREATE DATABASE trainyard OWNER trainyard;
REVOKE ALL ON DATABASE trainyard FROM PUBLIC;
SQL
