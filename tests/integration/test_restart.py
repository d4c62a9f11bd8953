"""A restarted server, on a private embedded PostgreSQL: a restart that completed before a call is
invisible to it, however many stale connections the pool held, and nothing is printed to stderr; a
restart still in progress gets DatabaseUnavailableError within the connect timeout. The asyncio face
likewise, and after pg_terminate_backend. Messages are counted and checksummed across the restarts."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue.engine import DatabaseUnavailableError, DbQueue
from airflow_dbqueue.engine.aio import AsyncDbQueue
from tests.dialects import run_sql
from tests.helpers import checksum

if TYPE_CHECKING:
    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

pytestmark = pytest.mark.integration


def fill_the_pool(dbq: DbQueue, n: int) -> None:
    """Make the pool open ``n`` connections (n callers at once), which then stay in it, idle."""
    barrier = threading.Barrier(n)

    def hold() -> None:
        with dbq.transaction() as conn:
            barrier.wait(timeout=30)
            run_sql(dbq, "SELECT 1", conn=conn)

    threads = [threading.Thread(target=hold) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_restart_that_completed_before_the_call_is_invisible(
    embedded_server: EmbeddedPostgres, capfd: pytest.CaptureFixture[str], mode: str
) -> None:
    with DbQueue(embedded_server.dsn, pool_size=6, connect_timeout=10) as dbq:
        dbq.install()
        q = dbq.create_queue("orders")
        sent = [{"n": i} for i in range(10)]
        q.push_batch(sent[:5])
        fill_the_pool(dbq, 6)  # six idle connections, each stale after the restart
        capfd.readouterr()
        for restart in range(2):
            embedded_server.stop(mode=mode)
            embedded_server.start()
            # the first calls after the restart, one after another and at once, all succeed
            q.push_batch(sent[5 + restart * 2 : 7 + restart * 2])
            errors: list[BaseException] = []

            def stats(errors: list[BaseException] = errors) -> None:
                try:
                    q.stats()
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=stats) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not errors, errors
            fill_the_pool(dbq, 6)
        got = [m.payload for m in q.pop(100)]
    assert len(got) == 9 and checksum(got) == checksum(sent[:9])
    err = capfd.readouterr().err
    assert "couldn't stop thread" not in err and err == "", err


def test_a_restart_in_progress_is_a_clear_error_and_the_next_call_works(
    embedded_server: EmbeddedPostgres, capfd: pytest.CaptureFixture[str]
) -> None:
    with DbQueue(embedded_server.dsn, pool_size=4, connect_timeout=2) as dbq:
        dbq.install()
        q = dbq.create_queue("orders")
        ids = q.push_batch([{"n": i} for i in range(4)])
        fill_the_pool(dbq, 4)
        capfd.readouterr()
        embedded_server.stop(mode="fast")
        with pytest.raises(DatabaseUnavailableError, match=r"127\.0\.0\.1:\d+/"):
            q.push({"n": 99})
        embedded_server.start()
        assert [m.id for m in q.pop(10)] == ids
    err = capfd.readouterr().err
    assert "couldn't stop thread" not in err, err


def test_pooled_connections_killed_while_idle_are_replaced_on_sql_server(
    mssql_dsn: str, schema_name: str
) -> None:
    """SQL Server given $DBQUEUE_TEST_MSSQL_DSN (skipped otherwise; never run yet): no server can be
    restarted from here, so the pooled sessions are killed (KILL) from another one, as a restart would
    end them; after an idle spell the next calls take new connections."""
    from tests.conftest import installed_dbq

    with installed_dbq(mssql_dsn, schema_name, dialect="mssql") as dbq:
        q = dbq.create_queue("orders")
        sent = [{"n": i} for i in range(6)]
        q.push_batch(sent[:3])
        fill_the_pool(dbq, 3)
        spids = [
            r[0]
            for r in run_sql(
                dbq, "SELECT session_id FROM sys.dm_exec_sessions WHERE program_name = 'airflow-dbqueue'"
            )
        ]
        with DbQueue(mssql_dsn, schema=schema_name, dialect="mssql") as killer:
            for spid in spids:
                run_sql(killer, f"KILL {int(spid)}")
        time.sleep(dbq.db.stale_after_s + 0.5)  # type: ignore[attr-defined]
        q.push_batch(sent[3:])
        got = [m.payload for m in q.pop(10)]
    assert len(got) == 6 and checksum(got) == checksum(sent)


async def fill_the_async_pool(adbq: AsyncDbQueue, n: int) -> None:
    """``fill_the_pool`` on the asyncio face: n tasks hold a pooled connection at once."""
    barrier = asyncio.Barrier(n)

    async def hold() -> None:
        async with adbq.transaction() as conn:
            await asyncio.wait_for(barrier.wait(), 30)
            await conn.execute("SELECT 1")

    await asyncio.gather(*(hold() for _ in range(n)))


def test_the_asyncio_face_replaces_connections_the_server_ended(
    embedded_server: EmbeddedPostgres, capfd: pytest.CaptureFixture[str]
) -> None:
    """The asyncio face's pooled connections, ended by pg_terminate_backend and then by a restart while
    idle: the next calls (pushes, pops, an ack of a lease taken before the restart, a waiting pop woken
    by a push) take new connections, and nothing is lost or doubled."""
    sent = [{"n": i} for i in range(12)]
    dsn = embedded_server.dsn

    def terminate_the_engines_sessions() -> int:
        # pg_terminate_backend only signals unless given a timeout; with one it returns once the
        # session has exited, its error written to the socket, which is the premise here: a call that
        # finds a session still ending is a race the engine cannot tell from a failure mid-statement.
        with psycopg.connect(dsn, autocommit=True) as c:
            row = c.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM pg_stat_activity "
                "WHERE application_name = 'airflow-dbqueue' AND pid <> pg_backend_pid()"
            ).fetchone()
        return int(row[0]) if row else 0

    async def main() -> list[Any]:
        async with AsyncDbQueue(dsn, pool_size=6, connect_timeout=10) as adbq:
            q = await adbq.create_queue("orders")
            await q.push_batch(sent[:4])
            await fill_the_async_pool(adbq, 6)
            assert await asyncio.to_thread(terminate_the_engines_sessions) == 6
            await q.push_batch(sent[4:8])  # first one call, then six at once
            await asyncio.gather(*(q.stats() for _ in range(6)))
            leased = await q.pop(3, semantics="at-least-once")
            await fill_the_async_pool(adbq, 6)
            await asyncio.to_thread(embedded_server.stop, mode="fast")
            await asyncio.to_thread(embedded_server.start)
            assert await q.ack(leased) == 3
            waiting = asyncio.create_task(q.pop(1, wait=20))
            await asyncio.sleep(0.5)
            await q.push_batch(sent[8:9])
            got = [*leased, *await waiting]
            await q.push_batch(sent[9:])
            got += await q.pop(100)
            assert (await q.stats(exact=True)).in_flight == 0
            return [m.payload for m in got]

    with DbQueue(dsn) as dbq:
        dbq.install()
    capfd.readouterr()
    got = asyncio.run(main())
    assert len(got) == 12 and checksum(got) == checksum(sent)
    err = capfd.readouterr().err
    assert "couldn't stop thread" not in err and err == "", err
