"""The ``dbq`` fixture of the suites that run on PostgreSQL and, given a DSN, on SQL Server.

A suite takes it by importing ``dialect_dbq`` (it registers under the name ``dbq``, overriding the
PostgreSQL-only one of ``tests/conftest.py`` in that module only).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from airflow_dbqueue.engine import DbQueue
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
