#!/usr/bin/env bash
# Run by the postgres image on its first start (an empty data volume) only: the role and database that
# hold Airflow's metadata, next to the queue database "dbqueue" that POSTGRES_DB creates. Later changes
# of AIRFLOW_DB_PASSWORD need an ALTER ROLE by hand (or a fresh volume: docker compose down -v).
set -euo pipefail
: "${AIRFLOW_DB_PASSWORD:?AIRFLOW_DB_PASSWORD must be set (docker-compose.yml gives it a local default)}"
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v airflow_password="$AIRFLOW_DB_PASSWORD" <<'SQL'
CREATE ROLE airflow LOGIN PASSWORD :'airflow_password';
CREATE DATABASE airflow OWNER airflow;
SQL
