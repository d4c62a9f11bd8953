"""The SQL Server dialect (pyodbc)."""

from airflow_dbqueue.engine.dialects.mssql.dialect import NOT_YET_PORTED, POSTGRES_ONLY, MssqlDatabase

__all__ = ["NOT_YET_PORTED", "POSTGRES_ONLY", "MssqlDatabase"]
