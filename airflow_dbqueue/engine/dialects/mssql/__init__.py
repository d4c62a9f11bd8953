"""The SQL Server dialect (pyodbc)."""

from airflow_dbqueue.engine.dialects.mssql.dialect import NOT_YET_PORTED, MssqlDatabase

__all__ = ["NOT_YET_PORTED", "MssqlDatabase"]
