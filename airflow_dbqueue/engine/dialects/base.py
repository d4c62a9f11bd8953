"""The seam between the queue designs and a database: what a dialect offers the engine.

A dialect (``dialects/postgres``, ``dialects/mssql``) holds all of one database's SQL as named blocks
under the same names, and a class that runs them. The designs (``table.py``) and the client only call
the methods of :class:`Database` below, so they never know which database they run on.

Connections are the driver's own objects (a psycopg connection, a pyodbc connection); callers pass
back what :meth:`Database.transaction` gave them (exactly-once work), so they are typed
:data:`DbConnection` here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable
from urllib.parse import urlsplit

from airflow_dbqueue.engine.errors import ConfigurationError, SchemaError

DbConnection: TypeAlias = Any
"""A driver connection of the dialect in use (psycopg or pyodbc), with a transaction open."""

POSTGRESQL = "postgresql"
MSSQL = "mssql"
DIALECTS = (POSTGRESQL, MSSQL)


class Listener(Protocol):
    """A wake-up source: :meth:`wait` returns True when something may have arrived."""

    def wait(self, timeout: float) -> bool: ...


@runtime_checkable
class Database(Protocol):
    """One dbqueue schema on one database, through one driver."""

    dialect_name: str
    schema: str
    where: str
    dsn: str
    #: True when the database can wake a waiting pop (LISTEN/NOTIFY); False means polling.
    supports_notify: bool

    def close(self) -> None: ...

    def install(self) -> int: ...

    def drop_schema(self) -> None: ...

    def fetchall(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: DbConnection | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> list[tuple[Any, ...]]: ...

    def fetchone(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: DbConnection | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> tuple[Any, ...] | None: ...

    def execute(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: DbConnection | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> int: ...

    def render(self, name: str, params: Mapping[str, Any]) -> str: ...

    def transaction(self, conn: DbConnection | None = None) -> contextlib.AbstractContextManager[Any]: ...

    def translate_errors(self) -> contextlib.AbstractContextManager[None]: ...

    def in_transaction(self, conn: DbConnection) -> bool: ...

    def guarded(self, conn: DbConnection | None) -> contextlib.AbstractContextManager[Any]:
        """Yield what to pass as ``conn`` so that a statement that fails leaves ``conn``'s transaction
        as it was before (a savepoint where one is needed); None stays None (a pooled connection)."""
        ...

    def channel(self, queue_id: int) -> str: ...

    def listening(self, channel: str) -> contextlib.AbstractContextManager[Any]: ...


def refuse_newer_schema(schema: str, where: str, current: int, latest: int) -> None:
    """Raise :class:`SchemaError` when an installed schema is newer than this code knows (installs
    and migrations never downgrade or touch it)."""
    if current > latest:
        raise SchemaError(
            f"schema {schema!r} at {where} is at version {current}, newer than this code's {latest}; "
            "upgrade airflow-dbqueue"
        )


def dialect_of_dsn(dsn: str) -> str:
    """Return the dialect a connection string names: ``postgresql`` or ``mssql``.

    SQL Server is named by a URL scheme ``mssql://`` (also ``mssql+pyodbc://``, ``sqlserver://``) or by
    an ODBC connection string (``DRIVER=...;SERVER=...``, or ``odbc:`` followed by one). Everything else
    is left to libpq, as before.
    """
    text = dsn.strip()
    scheme = urlsplit(text).scheme.lower() if "://" in text else ""
    if scheme in ("postgres", "postgresql"):
        return POSTGRESQL
    if scheme in ("mssql", "mssql+pyodbc", "sqlserver"):
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
) -> Database:
    """Build the dialect's :class:`Database` for ``dsn`` (no I/O: pools open on first use)."""
    name = (dialect or dialect_of_dsn(dsn)).lower()
    if name in ("postgres", POSTGRESQL):
        from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase

        return PostgresDatabase(
            dsn, schema=schema, min_size=1, max_size=pool_size, connect_timeout=connect_timeout
        )
    if name in (MSSQL, "sqlserver", "odbc"):
        from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase

        return MssqlDatabase(dsn, schema=schema, max_size=pool_size, connect_timeout=connect_timeout)
    raise ConfigurationError(f"unknown dialect {dialect!r}; choose one of {', '.join(DIALECTS)}")
