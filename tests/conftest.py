"""Shared fixtures: a real PostgreSQL for the whole test session.

``$DBQUEUE_TEST_DSN`` names a server to use; otherwise the session starts a throwaway embedded
server on a free port and stops it at the end. Every test gets its own schema, dropped afterwards,
except the tests of a suite on ``tests/dialects.py``'s ``topology_dbq``, which share one a module (each
finds it without a queue) unless marked ``own_schema``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.embedded import EmbeddedPostgres
from tests.helpers import require
from tests.pgbouncer import PgBouncer, find_pgbouncer

TEST_DSN_ENV = "DBQUEUE_TEST_DSN"
MSSQL_DSN_ENV = "DBQUEUE_TEST_MSSQL_DSN"
"""A SQL Server to run the suites against too (``mssql://user:pw@host:1433/db?Encrypt=no``)."""

SESSION_SERVER_SETTINGS = {"fsync": "off"}
"""The session's embedded server does not fsync: its data directory is thrown away at the end, and no
test crashes it (the crash tests kill a server of their own, :func:`embedded_server`, which keeps the
default). A commit still writes its WAL and waits for that write, as on any server; only the flush to
disk is skipped, which on this machine's disk took about 6 ms a commit (1,000 single-row commits: 7.4 to
9.7 s with fsync, 3.8 s without, at load 20)."""


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """DSN of the session's PostgreSQL server."""
    dsn = os.environ.get(TEST_DSN_ENV)
    if dsn:
        yield dsn
        return
    tmp = Path(tempfile.mkdtemp(prefix="dbqueue-test-pg-"))
    server = EmbeddedPostgres(tmp / "data", settings=SESSION_SERVER_SETTINGS)
    try:
        yield server.start()
    finally:
        server.stop(mode="immediate")  # its data is deleted next: no shutdown checkpoint to wait for
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def mssql_dsn() -> str:
    """DSN of a SQL Server from ``$DBQUEUE_TEST_MSSQL_DSN``; tests that need one are skipped without it."""
    dsn = os.environ.get(MSSQL_DSN_ENV)
    if not dsn:
        pytest.skip(f"no SQL Server: set ${MSSQL_DSN_ENV} to run this against one")
    return dsn


@pytest.fixture
def schema_name() -> str:
    """A fresh schema name for one test."""
    return f"t_{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def running_pgbouncer(pg_dsn: str) -> Iterator[PgBouncer]:
    """A real PgBouncer in front of ``pg_dsn`` (``tests/pgbouncer.py``), stopped on exit; the test is
    stopped (skipped, or failed under ``scripts/test``) where pgbouncer is not installed."""
    binary = find_pgbouncer()
    require(None if binary else "pgbouncer is not installed", "apt-get install pgbouncer")
    assert binary is not None
    bouncer = PgBouncer(pg_dsn, binary)
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture(scope="session")
def pgbouncer(pg_dsn: str) -> Iterator[PgBouncer]:
    """A real PgBouncer in front of the session's server, for the session."""
    with running_pgbouncer(pg_dsn) as bouncer:
        yield bouncer


@contextlib.contextmanager
def installed_dbq(
    dsn: str,
    schema: str,
    dialect: str | None = None,
    *,
    pooler: str | None = None,
    listen_dsn: str | None = None,
) -> Iterator[DbQueue]:
    """A DbQueue on ``schema``, installed; the schema is dropped afterwards."""
    q = DbQueue(dsn, schema=schema, pool_size=8, dialect=dialect, pooler=pooler, listen_dsn=listen_dsn)
    q.install()
    try:
        yield q
    finally:
        try:
            q.uninstall()
        finally:
            q.close()


@pytest.fixture
def dbq(pg_dsn: str, schema_name: str) -> Iterator[DbQueue]:
    """A DbQueue on a fresh, installed schema; the schema is dropped after the test."""
    with installed_dbq(pg_dsn, schema_name) as q:
        yield q


@pytest.fixture
def default_dbq(pg_dsn: str, schema_name: str) -> Iterator[DbQueue]:
    """A DbQueue with the engine's defaults (its pool of ten, where :func:`dbq`'s has eight), installed;
    uninstalled afterwards."""
    with DbQueue(pg_dsn, schema=schema_name) as d:
        d.install()
        try:
            yield d
        finally:
            d.uninstall()


@pytest.fixture
def embedded_server() -> Iterator[EmbeddedPostgres]:
    """A private embedded server for tests that kill and restart it."""
    tmp = Path(tempfile.mkdtemp(prefix="dbqueue-crash-pg-"))
    server = EmbeddedPostgres(tmp / "data")
    server.start()
    try:
        yield server
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(tmp, ignore_errors=True)


SHARED_SERVER_RISK = {
    TEST_DSN_ENV: "tests that count or end its sessions by application name would disturb each other",
    MSSQL_DSN_ENV: "the SQL Server suites have never run side by side on one server",
}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist: the suite's scheduling (``tests/xdist_scheduling.py``), and a refusal of a
    shared server. Each worker starts an embedded PostgreSQL of its own; a server named by
    ``$DBQUEUE_TEST_DSN`` or ``$DBQUEUE_TEST_MSSQL_DSN`` would be shared by the workers instead
    (:data:`SHARED_SERVER_RISK` says what that would risk), so ``-n`` is refused with one, at once."""
    config.addinivalue_line(
        "markers",
        "own_schema: a test of a suite on shared schemas that gets one of its own (tests/dialects.py)",
    )
    if config.pluginmanager.hasplugin("xdist"):
        from tests.xdist_scheduling import Plugin  # imports pytest-xdist

        config.pluginmanager.register(Plugin(), "dbqueue-xdist-scheduling")
    workers = getattr(config.option, "numprocesses", None)
    shared = [name for name in (TEST_DSN_ENV, MSSQL_DSN_ENV) if os.environ.get(name)]
    if workers and shared:
        raise pytest.UsageError(
            f"${shared[0]} names one server that every pytest-xdist worker (-n {workers}) would share, "
            f"and {SHARED_SERVER_RISK[shared[0]]}: run without -n"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each face and topology adds minutes to the conformance suite, so two of its combinations are left
    out: a ring of the rows layout (and a group of one) runs on the synchronous face against the server
    directly only, and the asyncio face runs against the server directly only, not behind PgBouncer (it
    sends the synchronous face's named statements; both faces run against the server, and the
    synchronous face behind PgBouncer in transaction mode). Behind PgBouncer in session mode, where a
    client keeps one server connection for its session as a direct client does, the suite runs on the
    table design only."""
    keep, drop = [], []
    for item in items:
        name = item.nodeid
        conformance = "test_conformance.py" in name
        rows_elsewhere = "[ring-rows-" in name and not any(
            f"[ring-rows-{group}sync-postgresql" in name for group in ("", "group-")
        )
        session_mode = "-sync-pgbouncer-session" in name and "[table-" not in name
        if conformance and (rows_elsewhere or session_mode or "-async-pgbouncer-" in name):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
