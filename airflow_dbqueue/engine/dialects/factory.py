"""The one place that knows the dialects: which one a connection string names, the :class:`Database`
of each, and what a layer above the engine needs of a dialect without importing it (a connection string
built from an Airflow connection's fields, a JDBC reader's options). The dialects' modules are imported
only when a database of theirs is made, so importing the engine imports no database driver."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from airflow_dbqueue.engine.dialects.base import (
    DIALECTS,
    MSSQL,
    MSSQL_URL_SCHEMES,
    POOLER_NONE,
    POSTGRESQL,
    Database,
    check_pooler,
)
from airflow_dbqueue.engine.errors import ConfigurationError, NotSupportedError


def dialect_of_dsn(dsn: str) -> str:
    """Return the dialect a connection string names: ``postgresql`` or ``mssql``.

    SQL Server is named by a URL scheme of :data:`MSSQL_URL_SCHEMES` (``mssql://``) or by
    an ODBC connection string (``DRIVER=...;SERVER=...``, or ``odbc:`` followed by one). Everything else
    is a PostgreSQL connection string or URL, for libpq.
    """
    text = dsn.strip()
    scheme = urlsplit(text).scheme.lower() if "://" in text else ""
    if scheme in ("postgres", "postgresql"):
        return POSTGRESQL
    if scheme in MSSQL_URL_SCHEMES:
        return MSSQL
    lowered = text.lower()
    if lowered.startswith("odbc:") or (
        ";" in text and any(k in lowered for k in ("driver=", "server=", "dsn="))
    ):
        return MSSQL
    return POSTGRESQL


def make_database(
    dsn: str,
    *,
    dialect: str | None = None,
    schema: str,
    pool_size: int,
    connect_timeout: float,
    pooler: str | None = None,
    listen_dsn: str | None = None,
) -> Database:
    """Build the dialect's :class:`Database` for ``dsn`` (no I/O: pools open on first use).

    ``pooler`` and ``listen_dsn`` are PostgreSQL's (see :class:`PostgresDatabase`)."""
    name = (dialect or dialect_of_dsn(dsn)).lower()
    pooler = check_pooler(pooler)
    if name in ("postgres", POSTGRESQL):
        from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase

        return PostgresDatabase(
            dsn,
            schema=schema,
            min_size=1,
            max_size=pool_size,
            connect_timeout=connect_timeout,
            pooler=pooler,
            listen_dsn=listen_dsn,
        )
    if name in (MSSQL, "sqlserver", "odbc"):
        if pooler != POOLER_NONE or listen_dsn:
            raise ConfigurationError(
                "pooler and listen_dsn are PostgreSQL's: SQL Server has no transaction pooler and no LISTEN"
            )
        from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase

        return MssqlDatabase(dsn, schema=schema, max_size=pool_size, connect_timeout=connect_timeout)
    raise ConfigurationError(f"unknown dialect {dialect!r}; choose one of {', '.join(DIALECTS)}")


def make_async_database(db: Database, *, pool_size: int) -> Any:
    """The asyncio face's database over ``db`` (its settings, statements and error translation): an
    ``AsyncPostgres`` on psycopg's async pool. Other dialects have no asyncio driver here: raise
    :class:`NotSupportedError` naming what to use instead."""
    if db.dialect_name != POSTGRESQL:
        raise NotSupportedError(
            f"AsyncDbQueue needs PostgreSQL (psycopg's asyncio connections); {db.dialect_name} has no "
            "asyncio driver here: use DbQueue, from a thread (asyncio.to_thread) in an asyncio "
            "application"
        )
    from airflow_dbqueue.engine.dialects.postgres.aio import AsyncPostgres

    return AsyncPostgres(db, max_size=pool_size)  # type: ignore[arg-type]


def postgres_dsn(params: Mapping[str, Any]) -> str:
    """A PostgreSQL connection string of ``params`` (``host``, ``port``, ``user``, ``password``,
    ``dbname`` and libpq's options); those that are None are left out."""
    from airflow_dbqueue.engine.dialects.postgres.conninfo import make_dsn

    return make_dsn(params)


def jdbc_options(dsn: str, *, transaction_pooler: bool = False) -> dict[str, str]:
    """Spark JDBC options (``url``, ``user``, ``password``) for the PostgreSQL database of ``dsn``
    (see the PostgreSQL dialect's ``conninfo.jdbc_options``)."""
    from airflow_dbqueue.engine.dialects.postgres.conninfo import jdbc_options as postgres_jdbc_options

    return postgres_jdbc_options(dsn, transaction_pooler=transaction_pooler)
