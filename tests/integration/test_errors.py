"""Clear errors for an unreachable database and a missing schema, with the queue data left intact."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import psycopg
import pytest

from airflow_dbqueue.engine import (
    DatabaseUnavailableError,
    DbQueue,
    DeadlockError,
    LockTimeoutError,
    SchemaError,
    TransientDatabaseError,
)
from airflow_dbqueue.engine.embedded import free_port

if TYPE_CHECKING:
    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

pytestmark = pytest.mark.integration


def test_unreachable_database_is_named() -> None:
    port = free_port()  # nothing listens there
    dbq = DbQueue(f"host=127.0.0.1 port={port} user=postgres dbname=app password=secret", connect_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(DatabaseUnavailableError) as err:
        dbq.install()
    assert time.monotonic() - t0 < 30  # bounded by connect_timeout, not hanging
    msg = str(err.value)
    assert f"127.0.0.1:{port}/app" in msg
    assert "secret" not in msg
    dbq.close()


def test_missing_schema_says_install(pg_dsn: str) -> None:
    dbq = DbQueue(pg_dsn, schema="never_installed_here")
    with pytest.raises(SchemaError, match="not installed"):
        dbq.queue("orders")
    dbq.close()


def test_server_restart_is_survived_by_the_pool(embedded_server: EmbeddedPostgres) -> None:
    with DbQueue(embedded_server.dsn, pool_size=4, connect_timeout=5) as dbq:
        dbq.install()
        q = dbq.create_queue("orders")
        ids = q.push_batch(list(range(10)))
        embedded_server.stop(mode="fast")
        with pytest.raises(DatabaseUnavailableError):
            q.push(99)
        embedded_server.start()
        # the failed call made the pool drop its dead connections: the next call just works
        assert q.stats().ready == 10
        assert [m.id for m in q.pop(20)] == ids


def test_lock_and_statement_timeouts_are_transient_not_unreachable(dbq: DbQueue, pg_dsn: str) -> None:
    """A lock timeout or a cancelled statement says so, and the pool keeps its connections."""
    q = dbq.create_queue("locked")
    ids = q.push_batch([1, 2, 3])
    pool_before = dbq.db._pool  # type: ignore[attr-defined]
    with psycopg.connect(pg_dsn) as holder, dbq.transaction() as conn:
        holder.execute(f'LOCK TABLE "{dbq.schema}".meta IN ACCESS EXCLUSIVE MODE')
        conn.execute("SET LOCAL lock_timeout = '200ms'")
        with pytest.raises(LockTimeoutError, match="not granted in time") as err:
            q.push(4, conn=conn)
        assert not isinstance(err.value, DatabaseUnavailableError)
        holder.rollback()
    with psycopg.connect(pg_dsn) as holder, dbq.transaction() as conn:
        holder.execute(f'LOCK TABLE "{dbq.schema}".meta IN ACCESS EXCLUSIVE MODE')
        conn.execute("SET LOCAL statement_timeout = '200ms'")
        with pytest.raises(TransientDatabaseError, match="cancelled") as err2:
            q.push(4, conn=conn)
        assert not isinstance(err2.value, DatabaseUnavailableError)
        holder.rollback()
    assert dbq.db._pool is pool_before  # type: ignore[attr-defined]
    assert [m.id for m in q.pop(10)] == ids  # nothing half written: only the first three


def test_deadlock_is_named(dbq: DbQueue, pg_dsn: str) -> None:
    """Two transactions that lock each other's messages: the victim gets DeadlockError."""
    import threading

    q = dbq.create_queue("deadlocks")
    a, b = q.push_batch(["a", "b"])
    [ma] = q.pop(1, semantics="at-least-once")
    [mb] = q.pop(1, semantics="at-least-once")
    barrier = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def worker(first: object, second: object) -> None:
        try:
            with dbq.transaction() as conn:
                q.ack([first], conn=conn)  # type: ignore[list-item]
                barrier.wait()
                q.ack([second], conn=conn)  # type: ignore[list-item]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=p) for p in ((ma, mb), (mb, ma))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 1 and isinstance(errors[0], DeadlockError), errors
    assert "deadlock" in str(errors[0])
    st = q.stats()  # the survivor acked both; the victim's acks rolled back with it
    assert (st.ready, st.in_flight, st.finished) == (0, 0, 2)
    assert {a, b} == {ma.id, mb.id}
