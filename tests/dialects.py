"""The ``dbq`` fixture of the suites that run on PostgreSQL and, given a DSN, on SQL Server.

A suite takes it by importing ``dialect_dbq`` (it registers under the name ``dbq``, overriding the
PostgreSQL-only one of ``tests/conftest.py`` in that module only).

:func:`run_sql` and :func:`insert_rows` run a test's own SQL (a results table, a look at the queue's
tables) on either dialect, through the engine's connections and error translation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase
from airflow_dbqueue.engine.dialects.mssql.dialect import to_positional
from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase
from tests.conftest import installed_dbq

DIALECTS = ["postgresql", "mssql"]


@pytest.fixture(params=DIALECTS, name="dbq")
def dialect_dbq(request: pytest.FixtureRequest, schema_name: str) -> Iterator[DbQueue]:
    """A DbQueue on a fresh, installed schema of each dialect; dropped after the test."""
    dsn = request.getfixturevalue("pg_dsn" if request.param == "postgresql" else "mssql_dsn")
    with installed_dbq(dsn, schema_name, dialect=request.param) as q:
        yield q


def postgres_only(dbq: DbQueue, why: str) -> None:
    if dbq.dialect != "postgresql":
        pytest.skip(f"PostgreSQL only on {dbq.dialect}: {why}")


def mssql_only(dbq: DbQueue, why: str) -> None:
    if dbq.dialect != "mssql":
        pytest.skip(f"SQL Server only on {dbq.dialect}: {why}")


def run_sql(
    dbq: DbQueue,
    body: str,
    params: Mapping[str, Any] | None = None,
    conn: Any | None = None,
    *,
    identifiers: Mapping[str, str] | None = None,
) -> list[tuple[Any, ...]]:
    """Run one statement written for both dialects; return its rows (``[]`` when it returns none).

    ``body`` is written as the engine's ``queries.sql`` are: ``{schema}`` and the ``identifiers``'
    placeholders (``{table}``) are quoted by the dialect (``"x"`` or ``[x]``), parameters are
    ``%(name)s``. With ``conn`` (from ``dbq.transaction()``) the statement joins that transaction;
    without, it runs in a transaction of its own on a pooled connection. Driver errors become the
    engine's (``DatabaseError``, ``DatabaseUnavailableError``...).
    """
    db = dbq.db
    if conn is None:
        with db.transaction() as own:
            return run_sql(dbq, body, params, own, identifiers=identifiers)
    with db.translate_errors():
        if isinstance(db, MssqlDatabase):
            text, values = to_positional(db.compose(body, identifiers), params)
            cur = conn.cursor()
            try:
                if values:
                    cur.execute(text, values)
                else:
                    cur.execute(text)
                return [tuple(r) for r in cur.fetchall()] if cur.description else []
            finally:
                cur.close()
        if not isinstance(db, PostgresDatabase):
            raise TypeError(f"no SQL runner for the {dbq.dialect} dialect")
        pg = conn.execute(db.compose(body, identifiers), params)
        return list(pg.fetchall()) if pg.description else []


def insert_rows(
    dbq: DbQueue, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], conn: Any | None = None
) -> None:
    """Insert ``rows`` into ``{schema}.table`` with one multi-row ``INSERT ... VALUES`` (both dialects).

    SQL Server takes at most 1000 rows and 2100 parameters in one statement: keep batches below that.
    """
    if not rows:
        return
    if any(len(r) != len(columns) for r in rows):
        raise ValueError(f"every row must have {len(columns)} values ({', '.join(columns)})")
    names = {f"c{i}": c for i, c in enumerate(columns)}
    cols = ", ".join(f"{{c{i}}}" for i in range(len(columns)))
    values = ", ".join(
        "(" + ", ".join(f"%(r{j}_{i})s" for i in range(len(columns))) + ")" for j in range(len(rows))
    )
    params = {f"r{j}_{i}": v for j, row in enumerate(rows) for i, v in enumerate(row)}
    run_sql(
        dbq,
        f"INSERT INTO {{schema}}.{{table}} ({cols}) VALUES {values}",
        params,
        conn,
        identifiers={"table": table, **names},
    )
