"""A server whose DBA set low timeouts (on a database of the test's own): the engine's calls complete or
fail with the engine's typed errors, connections the server closed are replaced unseen, and a waiting
pop is not cut short by ``statement_timeout``."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import psycopg.conninfo
import pytest

from airflow_dbqueue.engine import (
    DatabaseUnavailableError,
    LockTimeoutError,
    StatementTimeoutError,
)
from tests.conftest import installed_dbq
from tests.helpers import checksum

pytestmark = pytest.mark.integration


@pytest.fixture
def strict_db(pg_dsn: str) -> Iterator[Callable[..., str]]:
    """Make databases of the test's own with the given settings (``ALTER DATABASE ... SET``); return
    their DSNs. Dropped afterwards."""
    made: list[str] = []

    def make(**settings: str) -> str:
        name = f"dbq_strict_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
            made.append(name)
            for key, value in settings.items():
                c.execute(f"ALTER DATABASE \"{name}\" SET {key} = '{value}'")
        return psycopg.conninfo.make_conninfo(pg_dsn, dbname=name)

    yield make
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        for name in made:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_connections_the_server_closed_when_idle_are_replaced_unseen(strict_db: Callable[..., str]) -> None:
    """``idle_session_timeout``: the server closes every pooled connection that sits idle; the next
    calls get new ones, and see nothing."""
    dsn = strict_db(idle_session_timeout="300ms")
    with installed_dbq(dsn, "q") as dbq:
        q = dbq.create_queue("q")
        ring = dbq.create_queue("r", design="ring", capacity=100)
        sent: list[int] = []
        got: list[int] = []
        for round_ in range(3):
            time.sleep(0.8)  # every idle connection of the pool is closed by now
            batch = list(range(round_ * 10, round_ * 10 + 10))
            for queue in (q, ring):
                queue.push_batch(batch)
                msgs = queue.pop(10, semantics="at-least-once")
                queue.ack(msgs)
                got.extend(m.payload for m in msgs)
            sent.extend(batch * 2)
        assert checksum(got) == checksum(sent)


def test_a_callers_transaction_left_idle_too_long(strict_db: Callable[..., str]) -> None:
    """``idle_in_transaction_session_timeout``: the server ends a transaction that idles past it. The
    next call in it raises ``DatabaseUnavailableError``; what it popped is ready again; the engine goes
    on with new connections."""
    dsn = strict_db(idle_in_transaction_session_timeout="300ms")
    with installed_dbq(dsn, "q") as dbq:
        q = dbq.create_queue("q")
        q.push_batch(["a", "b"])
        with pytest.raises(DatabaseUnavailableError), dbq.transaction() as conn:
            assert len(q.pop(2, semantics="exactly-once", conn=conn)) == 2
            time.sleep(0.8)
            q.push("c", conn=conn)
        got = q.pop(10, semantics="at-most-once")
        assert sorted(m.payload for m in got) == ["a", "b"]


@pytest.mark.parametrize(
    ("setting", "error"), [("lock_timeout", LockTimeoutError), ("statement_timeout", StatementTimeoutError)]
)
def test_a_call_held_up_by_a_lock_fails_typed_and_changes_nothing(
    strict_db: Callable[..., str], setting: str, error: type[Exception]
) -> None:
    """A drop of a queue waits for the pushes in progress (their lock); past the database's
    ``lock_timeout`` or ``statement_timeout`` it fails with the engine's error, and the queue keeps
    its messages."""
    dsn = strict_db(**{setting: "300ms"})
    with installed_dbq(dsn, "q") as dbq:
        q = dbq.create_queue("q")
        q.push_batch([1, 2, 3])
        with dbq.transaction() as pushing:
            q.push(4, conn=pushing)  # holds the queue's push lock until it ends
            with pytest.raises(error):
                dbq.drop_queue("q")
        got = dbq.queue("q").pop(10, semantics="at-most-once")
        assert sorted(m.payload for m in got) == [1, 2, 3, 4]


def test_a_waiting_pop_outlives_statement_timeout(strict_db: Callable[..., str]) -> None:
    """A pop that waits longer than ``statement_timeout`` for a message waits between statements (on
    LISTEN, or polling), so no statement runs past the limit."""
    dsn = strict_db(statement_timeout="200ms")
    with installed_dbq(dsn, "q") as dbq:
        q = dbq.create_queue("q")
        ring = dbq.create_queue("r", design="ring", capacity=100)
        for queue, payload in ((q, "late"), (ring, "late too")):
            timer = threading.Timer(1.0, lambda queue=queue, payload=payload: queue.push(payload))
            timer.start()
            started = time.monotonic()
            got = queue.pop(1, wait=5, poll_interval=0.3)
            timer.join()
            assert [m.payload for m in got] == [payload]
            assert time.monotonic() - started >= 0.9
        assert q.pop(1, wait=0.6) == []  # waited past the limit, found nothing, raised nothing
