"""A restarted server, on a private embedded PostgreSQL: a restart that completed before a call is
invisible to it, however many stale connections the pool held, and nothing is printed to stderr; a
restart still in progress gets DatabaseUnavailableError within the connect timeout. Messages are counted
and checksummed across the restarts."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import pytest

from airflow_dbqueue.engine import DatabaseUnavailableError, DbQueue
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
