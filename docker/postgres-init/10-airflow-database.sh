#!/usr/bin/env bash
# Run by the postgres image on its first start (an empty data volume) only, as the superuser. It makes
# two ordinary roles, neither a superuser, each owning one database that the other cannot connect to:
#   dbqueue  the queue database "dbqueue" (queues, and the pipeline's results schema); pg_monitor lets
#            maintenance name what holds the xmin horizon back in other sessions
#   airflow  Airflow's metadata database "airflow"
# Later changes of the passwords need an ALTER ROLE by hand (or a fresh volume: docker compose down -v).
set -euo pipefail
: "${DBQUEUE_DB_PASSWORD:?DBQUEUE_DB_PASSWORD must be set (docker-compose.yml gives it a local default)}"
: "${AIRFLOW_DB_PASSWORD:?AIRFLOW_DB_PASSWORD must be set (docker-compose.yml gives it a local default)}"
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v dbqueue_password="$DBQUEUE_DB_PASSWORD" -v airflow_password="$AIRFLOW_DB_PASSWORD" <<'SQL'
CREATE ROLE dbqueue LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'dbqueue_password';
CREATE ROLE airflow LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'airflow_password';
GRANT pg_monitor TO dbqueue;
CREATE DATABASE dbqueue OWNER dbqueue;
CREATE DATABASE airflow OWNER airflow;
REVOKE CONNECT, TEMPORARY ON DATABASE dbqueue FROM PUBLIC;
REVOKE CONNECT, TEMPORARY ON DATABASE airflow FROM PUBLIC;
GRANT CONNECT, TEMPORARY ON DATABASE dbqueue TO dbqueue;
GRANT CONNECT, TEMPORARY ON DATABASE airflow TO airflow;
SQL
