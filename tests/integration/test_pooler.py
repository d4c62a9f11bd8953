"""The engine behind a real connection pooler (Debian's PgBouncer, ``tests/pgbouncer.py``).

The conformance suite and the 4x4 concurrency test run through PgBouncer in both pool modes
(``tests/dialects.py``'s ``TOPOLOGIES``). This module holds what only a pooler shows: statements of the
same parameter count never confused across server connections, PgBouncer killed and restarted mid-run,
waiting pops with and without a listen DSN, and maintenance, which needs a session of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import (
    ConfigurationError,
    DatabaseUnavailableError,
    DbQueue,
    DbQueueError,
)
from airflow_dbqueue.engine.dialects.postgres import dialect as pg_dialect
from tests.conftest import installed_dbq, running_pgbouncer
from tests.helpers import checksum, payload_hash
from tests.pgbouncer import PgBouncer

pytestmark = pytest.mark.integration


def _confusions(dsn: str, prepare_threshold: int | None, *, threads: int = 6, rounds: int = 150) -> list[str]:
    """Run two statements of one parameter count from ``threads`` client connections at once, each in a
    transaction of its own; return every wrong result or error seen."""
    seen: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True, prepare_threshold=prepare_threshold) as c:
                # Each client runs its statements in its own order, so that a statement name means a
                # different statement on different clients.
                pair = [("SELECT %s::bigint + 1", 1), ("SELECT %s::bigint * -1", -1)]
                if k % 2:
                    pair.reverse()
                for i in range(rounds):
                    for text, sign in pair:
                        n = k * 1_000_000 + i
                        try:
                            row = c.execute(text, (n,)).fetchone()
                        except psycopg.Error as exc:
                            with lock:
                                seen.append(f"{type(exc).__name__}: {exc}")
                            continue
                        want = n + 1 if sign == 1 else -n
                        if row is None or row[0] != want:
                            with lock:
                                seen.append(f"{text} with {n} returned {row}")
        except psycopg.Error as exc:
            with lock:
                seen.append(f"connection: {exc}")

    ts = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return seen


def test_statements_of_one_parameter_count_are_never_confused_through_the_pooler(
    pgbouncer: PgBouncer,
) -> None:
    """Through two server connections shared by six clients in transaction mode: prepared statements
    (psycopg's at once, as the JDBC driver's after five runs) run under a name that, on the server
    connection the pooler picked, another client gave another statement. The engine's connections
    behind a transaction pooler prepare nothing: not one result wrong, not one error."""
    dsn = pgbouncer.dsn("narrow")
    # The hazard is real here: prepared, the same clients are refused or answered wrongly.
    prepared = _confusions(dsn, 0)
    assert prepared, (
        "the narrow pool did not move a client between server connections: the test shows nothing"
    )
    assert _confusions(dsn, None) == []


def test_two_queues_on_a_narrow_transaction_pool_keep_their_messages(
    pgbouncer: PgBouncer, pg_dsn: str, schema_name: str
) -> None:
    """Eight threads of one engine on two server connections push to and pop from a table and a ring
    queue at once; every message comes back from its own queue, once, with its own payload."""
    with installed_dbq(pgbouncer.dsn("narrow"), schema_name, pooler="transaction", listen_dsn=pg_dsn) as dbq:
        queues = {
            "t": dbq.create_queue("t", max_attempts=100),
            "r": dbq.create_queue("r", design="ring", capacity=500),
        }
        pushed: dict[str, list[Any]] = {"t": [], "r": []}
        popped: dict[str, list[Any]] = {"t": [], "r": []}
        errors: list[str] = []
        lock = threading.Lock()

        def worker(k: int) -> None:
            name = "tr"[k % 2]
            q = queues[name]
            try:
                for i in range(60):
                    batch = [{"q": name, "k": k, "i": i, "j": j} for j in range(5)]
                    q.push_batch(batch)
                    got = q.pop(5, semantics="at-least-once")
                    q.ack(got)
                    with lock:
                        pushed[name].extend(batch)
                        popped[name].extend(m.payload for m in got)
            except Exception as exc:  # reported below, with every other thread's
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert errors == []
        for name, q in queues.items():
            while got := q.pop(100, semantics="at-most-once"):
                popped[name].extend(m.payload for m in got)
            assert all(p["q"] == name for p in popped[name]), f"queue {name} returned another queue's message"
            assert len(popped[name]) == len(pushed[name]) == 4 * 60 * 5
            keys = {(p["k"], p["i"], p["j"]) for p in popped[name]}
            assert len(keys) == len(popped[name]), f"queue {name} delivered a message twice"
            assert checksum(popped[name]) == checksum(pushed[name])


@pytest.fixture
def own_pgbouncer(pg_dsn: str) -> Iterator[PgBouncer]:
    """A PgBouncer of the test's own, which it may kill."""
    with running_pgbouncer(pg_dsn) as bouncer:
        yield bouncer


class _Outage:
    """A producer and an exactly-once consumer on ``q`` that go on through errors, sorting them into
    outage errors (``DatabaseUnavailableError``) and others."""

    BATCHES, BATCH = 60, 20

    def __init__(self, dbq: DbQueue, schema: str) -> None:
        self.dbq, self.schema = dbq, schema
        self.q = dbq.create_queue("q")
        with dbq.transaction() as c:
            c.execute(f'CREATE TABLE "{schema}".t_pushed (b integer PRIMARY KEY)')
            c.execute(f'CREATE TABLE "{schema}".t_got (k text PRIMARY KEY, h bigint)')
        self.other_errors: list[str] = []
        self.third_pushed = threading.Event()
        self.done = threading.Event()

    def _failed(self, exc: BaseException) -> None:
        if not isinstance(exc, DatabaseUnavailableError):  # the outage's own error, expected
            self.other_errors.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.05)

    def produce(self) -> None:
        b = 0
        while b < self.BATCHES:
            try:
                with self.dbq.transaction() as c:
                    # The batch and its marker commit together: after an error the marker says whether
                    # the batch is in, so a retry never pushes it twice.
                    if c.execute(f'SELECT 1 FROM "{self.schema}".t_pushed WHERE b = %s', (b,)).fetchone():
                        b += 1
                        continue
                    self.q.push_batch([{"b": b, "j": j} for j in range(self.BATCH)], conn=c)
                    c.execute(f'INSERT INTO "{self.schema}".t_pushed VALUES (%s)', (b,))
                b += 1
                if b == self.BATCHES // 3:
                    self.third_pushed.set()
                    time.sleep(0.5)  # the consumer goes on while the pooler is down
            except DbQueueError as exc:
                self._failed(exc)

    def consume(self) -> None:
        while not self.done.is_set():
            try:
                with self.dbq.transaction() as c:
                    got = self.q.pop(25, semantics="exactly-once", conn=c)
                    for m in got:
                        key = f"{m.payload['b']}.{m.payload['j']}"
                        c.execute(
                            f'INSERT INTO "{self.schema}".t_got VALUES (%s, %s)',
                            (key, payload_hash(m.payload)),
                        )
                if not got:
                    time.sleep(0.02)
            except DbQueueError as exc:
                self._failed(exc)

    def expected(self) -> dict[str, int]:
        return {
            f"{b}.{j}": payload_hash({"b": b, "j": j}) for b in range(self.BATCHES) for j in range(self.BATCH)
        }


def test_pgbouncer_killed_and_restarted_mid_run(
    own_pgbouncer: PgBouncer, pg_dsn: str, schema_name: str
) -> None:
    """A producer and an exactly-once consumer run through PgBouncer in transaction mode while it is
    SIGKILLed and started again. A call in flight when it dies fails with the engine's
    ``DatabaseUnavailableError`` (one is held open across the kill, so that there is always one; the
    threads' own calls fail so only if the kill finds them mid-call, else they wait for the pooler to
    come back) and no call fails otherwise; afterwards both go on, and every message is in the results
    once."""
    with installed_dbq(own_pgbouncer.dsn("transaction"), schema_name, pooler="transaction") as dbq:
        run = _Outage(dbq, schema_name)
        producer = threading.Thread(target=run.produce)
        consumer = threading.Thread(target=run.consume)
        producer.start()
        consumer.start()
        assert run.third_pushed.wait(60)
        with pytest.raises(DatabaseUnavailableError), dbq.transaction() as held:
            held.execute("SELECT 1")
            own_pgbouncer.kill()
            run.q.pop(1, semantics="exactly-once", conn=held)
        time.sleep(1.5)
        own_pgbouncer.start()
        producer.join(120)
        assert not producer.is_alive()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and run.q.stats().ready:
            time.sleep(0.1)
        run.done.set()
        consumer.join(60)
        assert run.other_errors == [], run.other_errors
        with psycopg.connect(pg_dsn) as direct:
            rows = direct.execute(f'SELECT k, h FROM "{schema_name}".t_got').fetchall()
        assert dict(rows) == run.expected()
        st = run.q.stats()
        assert (st.ready, st.in_flight) == (0, 0)


def test_a_waiting_pop_behind_a_transaction_pooler_wakes_on_the_listen_dsn(
    pgbouncer: PgBouncer, pg_dsn: str, schema_name: str
) -> None:
    """With a listen DSN, a waiting pop LISTENs there and a push wakes it long before its poll; the
    engine's own pool (through the pooler) holds no connection while it waits."""
    with installed_dbq(
        pgbouncer.dsn("transaction"), schema_name, pooler="transaction", listen_dsn=pg_dsn
    ) as dbq:
        q = dbq.create_queue("q")
        timer = threading.Timer(0.5, lambda: q.push({"n": 1}))
        start = time.monotonic()
        timer.start()
        got = q.pop(1, wait=20, poll_interval=20)
        took = time.monotonic() - start
        timer.join()
        assert [m.payload for m in got] == [{"n": 1}]
        assert took < 5, f"the pop took {took:.1f}s: not woken by the push's NOTIFY"


@pytest.mark.parametrize("listen", [True, False], ids=["listen_dsn", "no_listen_dsn"])
def test_twenty_waiters_behind_a_transaction_pooler_get_every_message_once(
    pgbouncer: PgBouncer, pg_dsn: str, schema_name: str, listen: bool
) -> None:
    """Twenty threads wait on one queue behind the transaction pooler while one message is pushed every
    20 ms: with a listen DSN they wake on its one listening connection long before their poll; without
    one they poll (every 0.2 s). Either way every message arrives once, with no error."""
    poll = 60.0 if listen else 0.2
    with installed_dbq(
        pgbouncer.dsn("transaction"), schema_name, pooler="transaction", listen_dsn=pg_dsn if listen else None
    ) as dbq:
        q = dbq.create_queue("q")  # notify="auto"
        got: list[Any] = []
        late: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()

        def waiter() -> None:
            try:
                while not stop.is_set():
                    for m in q.pop(1, wait=2, poll_interval=poll):
                        with lock:
                            got.append(m.payload)
                            late.append(time.time() - m.payload["at"])
            except Exception as exc:  # reported below
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=waiter) for _ in range(20)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        sent = []
        for i in range(100):
            payload = {"i": i, "at": time.time()}
            q.push(payload)
            sent.append(payload)
            time.sleep(0.02)
        deadline = time.monotonic() + 20
        while len(got) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == []
    assert len(got) == len(sent) and checksum(got) == checksum(sent)
    if listen:
        assert max(late) < 5, f"a message waited {max(late):.1f}s: it was found by a poll"


def test_without_a_listen_dsn_a_waiting_pop_polls_and_a_warning_says_so_once(
    pgbouncer: PgBouncer, schema_name: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg_dialect, "_WARNED_POLLING", set())
    with (
        caplog.at_level(logging.WARNING, logger=pg_dialect.__name__),
        installed_dbq(pgbouncer.dsn("transaction"), schema_name, pooler="transaction") as dbq,
    ):
        DbQueue(pgbouncer.dsn("transaction"), schema=schema_name, pooler="transaction").close()
        assert not dbq.db.supports_notify
        q = dbq.create_queue("q")
        timer = threading.Timer(0.5, lambda: q.push({"n": 2}))
        timer.start()
        got = q.pop(1, wait=20, poll_interval=0.2)
        timer.join()
        assert [m.payload for m in got] == [{"n": 2}]
    warned = [r for r in caplog.records if "no listen_dsn" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_maintenance_behind_a_transaction_pooler_needs_the_listen_dsn(
    pgbouncer: PgBouncer, pg_dsn: str, schema_name: str
) -> None:
    """Maintenance holds a lock and sets timeouts for a whole run: without a session of its own it is
    refused, naming listen_dsn; with one it runs, and no lock is left on any server connection."""
    with installed_dbq(pgbouncer.dsn("transaction"), schema_name, pooler="transaction") as dbq:
        q = dbq.create_queue("q")
        q.push_batch([1, 2, 3])
        q.ack(q.pop(3, semantics="at-least-once"))
        with pytest.raises(ConfigurationError, match="listen_dsn"):
            dbq.maintain()
        with DbQueue(
            pgbouncer.dsn("transaction"), schema=schema_name, pooler="transaction", listen_dsn=pg_dsn
        ) as served:
            report = served.maintain()
        assert report["skipped"] is None and report["incomplete"] == [], report
        assert report["vacuum"]["tables"], report
        with psycopg.connect(pg_dsn) as direct:
            held = direct.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()
        assert held == (0,)


def test_a_bad_pooler_is_refused_at_once(pg_dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="pooler must be one of none, session, transaction"):
        DbQueue(pg_dsn, pooler="statement")
    with pytest.raises(ConfigurationError, match="not valid"):
        DbQueue(pg_dsn, pooler="transaction", listen_dsn="host=x port=notaport")
    with pytest.raises(ConfigurationError, match="PostgreSQL's"):
        DbQueue("mssql://u:p@h/db", pooler="transaction")
