"""The PostgreSQL dialect (psycopg 3)."""

from airflow_dbqueue.engine.dialects.postgres.dialect import PostgresDatabase

__all__ = ["PostgresDatabase"]
