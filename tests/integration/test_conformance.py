"""The conformance suite of the queue interface.

Every design and every dialect must pass it: add a design to ``DESIGNS`` and the whole suite runs
against it. Each test runs on PostgreSQL, and on SQL Server when ``$DBQUEUE_TEST_MSSQL_DSN`` names one
(skipped otherwise); the tests of PostgreSQL-only behaviour (NOTIFY) skip themselves on SQL Server, saying
so. A test's own SQL (a results table, a row count, a clock jump) goes through ``tests/dialects.py``'s
:func:`run_sql`/:func:`insert_rows`, one text for both dialects or one per dialect where they differ.
Each test counts and checksums what goes in and what comes out.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import psycopg
import psycopg.sql
import pytest

from airflow_dbqueue.engine import (
    ConfigurationError,
    InvalidNameError,
    LeaseExpiredError,
    PayloadTooLargeError,
    PayloadTypeError,
    QueueExistsError,
    QueueNotFoundError,
    Semantics,
    TransactionRequiredError,
)
from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase
from tests.dialects import (  # noqa: F401 - topology_dbq is the fixture "dbq", on topologies
    ResultsTable,
    behind_transaction_pooler,
    expire_leases,
    postgres_only,
    run_sql,
    topologies,
    topology_dbq,
)
from tests.faces import FACES, faced
from tests.helpers import checksum, notified_so_far

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from airflow_dbqueue.engine import DbQueue, Message, Queue

pytestmark = pytest.mark.integration

DESIGNS = ["table", "ring", "ring-group", "ring-rows", "ring-rows-group"]
"""A feature a design does not offer (the ring's priorities and delayed pushes) is checked to raise
:class:`ConfigurationError` rather than skipped. ``ring-group``: a ring's consumer group besides its
default one, whose handle must behave as a queue of its own; the default group holds every message the
tests push, untouched. ``ring-rows``: a ring of the rows layout (PostgreSQL only), which has no batches
(their refusals are tested in ``test_ring_rows.py``); ``ring-rows-group``: a consumer group of such a
ring, as ``ring-group``."""


SLOTS_RING_CAPACITY = 4096
"""The capacity of the rings of the slots layout the tests make: room for every message a test pushes (at
most 3,000; a consumer group's ring keeps them all for its default group, which nobody pops), with the
default lanes. Such a ring writes every slot when it is made: a ring of the default capacity (16,384)
took 0.4 s to make here, 1.4 s with slots of 4,000 bytes, and one of this capacity 0.1 s and 0.7 s."""


@pytest.fixture(params=FACES)
def client(request: pytest.FixtureRequest, dbq: DbQueue) -> Iterator[DbQueue]:
    """The face the test drives: ``dbq`` itself, or the asyncio face on its schema (tests/faces.py)."""
    yield from faced(request, dbq)


@pytest.fixture(params=DESIGNS)
def make_queue(request: pytest.FixtureRequest, client: DbQueue) -> Callable[..., Queue]:
    counter = iter(range(1000))
    design, _, variant = str(request.param).partition("-")
    if variant.startswith("rows"):
        if isinstance(client.db, MssqlDatabase):
            pytest.skip("the ring's rows layout is PostgreSQL-only")
        settings_of_layout: dict[str, Any] = {"layout": "rows"}
    elif design == "ring":  # named: PostgreSQL's default ring is of the rows layout
        settings_of_layout = {"layout": "slots", "capacity": SLOTS_RING_CAPACITY}
    else:
        settings_of_layout = {}

    def make(**settings: Any) -> Queue:
        q = client.create_queue(f"q{next(counter)}", design=design, **{**settings_of_layout, **settings})
        return q.add_group("g") if variant.endswith("group") else q  # type: ignore[attr-defined, no-any-return]

    return make


@contextlib.contextmanager
def callers_connection(dbq: DbQueue) -> Iterator[Any]:
    """A connection of the caller's own: not pooled, autocommit off, nothing run on it yet; closed on exit.

    psycopg's is idle (no transaction until its first statement); pyodbc's, the dialect's ``connect()``
    (XACT_ABORT on, so a server error would doom its transaction), is always in one.
    """
    if isinstance(dbq.db, MssqlDatabase):
        conn = dbq.db.connect()
    else:  # behind a transaction pooler, as docs/deploy.md asks of a caller's own connection there
        conn = psycopg.connect(dbq.db.dsn, prepare_threshold=None if behind_transaction_pooler(dbq) else 5)
    try:
        yield conn
    finally:
        conn.close()


RESULTS = ResultsTable([("n", "integer")], key=["n"])
"""The exactly-once test's own table: the popped messages' ``n`` (a duplicate breaks the key)."""


def pop_exactly_once(dbq: DbQueue, q: Queue, api: str, n: int, conn: Any) -> list[int]:
    """Pop up to ``n`` messages exactly once in ``conn``'s transaction through ``api`` (``pop`` or
    ``pop_payloads``) and write their payloads' ``n`` to the results table in it; return those."""
    if api == "pop":
        got = [m.payload["n"] for m in q.pop(n, semantics="exactly-once", conn=conn)]
    else:
        got = [p["n"] for p in q.pop_payloads(n, semantics="exactly-once", conn=conn)]
    RESULTS.write(dbq, conn, [[k] for k in got])
    return got


def read_results(dbq: DbQueue) -> list[int]:
    return [int(n) for (n,) in RESULTS.read(dbq)]


def count_rows(dbq: DbQueue, table: str, queue_id: int | None = None) -> int:
    """Rows of ``{schema}.table``, of one queue only when ``queue_id`` is given."""
    body, params = "SELECT count(*) FROM {schema}.{table}", None
    if queue_id is not None:
        body, params = body + " WHERE queue_id = %(queue_id)s", {"queue_id": queue_id}
    rows = run_sql(dbq, body, params, identifiers={"table": table})
    return int(rows[0][0])


def count_payloads(dbq: DbQueue, queue_id: int | None = None) -> tuple[int, int]:
    """Stored payloads of the table design: ``(in their own meta or done row, in data)``, of one queue
    only when ``queue_id`` is given."""
    of_queue = "" if queue_id is None else " AND queue_id = %(queue_id)s"
    rows = run_sql(
        dbq,
        f"SELECT (SELECT count(*) FROM {{schema}}.meta WHERE payload IS NOT NULL{of_queue}) "
        f"+ (SELECT count(*) FROM {{schema}}.done WHERE payload IS NOT NULL{of_queue}), "
        f"(SELECT count(*) FROM {{schema}}.data WHERE 1 = 1{of_queue})",
        None if queue_id is None else {"queue_id": queue_id},
    )
    return int(rows[0][0]), int(rows[0][1])


CLOCK_SQL = {
    "postgresql": {
        "due_now": "UPDATE {schema}.meta SET process_at = now() WHERE id = %(id)s",
        "due_in": "SELECT extract(epoch FROM process_at - now()) FROM {schema}.meta WHERE id = %(id)s",
    },
    "mssql": {
        "due_now": "UPDATE {schema}.meta SET process_at = SYSUTCDATETIME() WHERE id = %(id)s",
        "due_in": "SELECT DATEDIFF_BIG(millisecond, SYSUTCDATETIME(), process_at) / 1000.0 "
        "FROM {schema}.meta WHERE id = %(id)s",
    },
}
"""The backoff test's clock, one text per dialect (process_at is timestamptz, or datetime2 in UTC)."""


def make_due_now(dbq: DbQueue, msg_id: int) -> None:
    """Make a table-design message due now, as if its backoff had passed (tests only)."""
    run_sql(dbq, CLOCK_SQL[dbq.dialect]["due_now"], {"id": msg_id})


def due_in(dbq: DbQueue, msg_id: int) -> float:
    """Seconds until a table-design message is due, by the server's clock."""
    [(seconds,)] = run_sql(dbq, CLOCK_SQL[dbq.dialect]["due_in"], {"id": msg_id})
    return float(seconds)


def kept(q: Queue, n: int) -> int:
    """What ``stats().finished`` shows after ``n`` messages finished: kept for the archiver, or none."""
    return n if q.settings.archive else 0


def is_ring(q: Queue) -> bool:
    return bool(q.settings.design == "ring")


def is_rows(q: Queue) -> bool:
    """Whether ``q`` is a ring of the rows layout."""
    return bool(q.settings.layout == "rows")


def drain(q: Queue, semantics: str = "at-most-once", n: int = 100) -> list[Message]:
    out: list[Message] = []
    while batch := q.pop(n, semantics=semantics):
        out.extend(batch)
        if semantics == "at-least-once":
            q.ack(batch)
    return out


# -- push and pop ---------------------------------------------------------------------------------


@pytest.mark.parametrize("semantics", ["at-most-once", "at-least-once"])
def test_push_pop_roundtrip_counts_and_checksums(make_queue: Callable[..., Queue], semantics: str) -> None:
    q = make_queue()
    sent = [{"order": i, "sku": f"sku-{i % 7}", "qty": i % 5 + 1, "note": "é✓"} for i in range(1000)]
    ids = q.push_batch(sent[:500]) + [q.push(p) for p in sent[500:510]] + q.push_batch(sent[510:])
    assert len(ids) == len(set(ids)) == 1000
    got = drain(q, semantics, n=137)
    assert checksum(m.payload for m in got) == checksum(sent)
    assert sorted(m.id for m in got) == sorted(ids)
    assert all(m.attempts == 1 for m in got)
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 0, 0, 0)
    assert s.finished == kept(q, 1000)


@pytest.mark.parametrize("semantics", ["at-most-once", "at-least-once"])
def test_fifo_within_priority_and_priority_order(make_queue: Callable[..., Queue], semantics: str) -> None:
    q = make_queue()
    if is_ring(q):  # FIFO by id only: a priority is refused, and nothing is pushed
        with pytest.raises(ConfigurationError, match="without priorities"):
            q.push_batch(["high"], priority=10)
        ids = q.push_batch([f"m{i}" for i in range(5)]) + [q.push(f"late{i}") for i in range(3)]
        assert [m.id for m in drain(q, semantics, n=2)] == ids
        return
    low = q.push_batch([f"low{i}" for i in range(5)], priority=0)
    high = q.push_batch([f"high{i}" for i in range(3)], priority=10)
    low2 = [q.push(f"late{i}") for i in range(3)]
    neg = q.push("neg", priority=-5)
    # A pop of two takes high2 and low0 together: their claim order is not the order of their rows in
    # the table, so the pops must return claim order, not the order they found the rows in.
    order = [m.id for m in drain(q, semantics, n=2)]
    assert order == high + low + low2 + [neg]


def test_batch_ids_follow_payload_order(make_queue: Callable[..., Queue]) -> None:
    q = make_queue()
    ids = q.push_batch(list(range(50)))
    assert ids == sorted(ids) and len(set(ids)) == 50
    assert [(m.id, m.payload) for m in q.pop(50)] == list(zip(ids, range(50), strict=True))


@pytest.mark.parametrize(
    ("payload_type", "payloads"),
    [
        ("json", [{"a": [1, 2.5, None, True]}, "text", 7, None, [], {"nested": {"k": "ü"}}]),
        ("text", ["", "plain", "ünïcode ✓", "x" * 5000]),
        ("bytes", [b"", b"\x00\xff\x10", bytes(range(256)) * 40]),
    ],
)
def test_payload_types_roundtrip(
    make_queue: Callable[..., Queue], payload_type: str, payloads: list[Any]
) -> None:
    q = make_queue(payload_type=payload_type)
    if is_ring(q):  # slots hold payloads inline up to a limit: larger ones are refused clearly
        limit = q.settings.max_payload_bytes
        too_big = [p for p in payloads if len(p if isinstance(p, bytes) else str(p).encode()) > limit]
        for p in too_big:
            with pytest.raises(PayloadTooLargeError, match=rf"limit \(max_payload_bytes\) is {limit}"):
                q.push(p)
        payloads = [p for p in payloads if p not in too_big]
    q.push_batch(payloads)
    assert [m.payload for m in q.pop(len(payloads) + 5)] == payloads


def test_pop_on_empty_queue_returns_nothing(make_queue: Callable[..., Queue]) -> None:
    q = make_queue()
    assert q.pop(10) == []
    assert q.pop(10, semantics="at-least-once") == []
    assert q.stats().ready == 0


def test_delayed_messages_wait_for_their_time(make_queue: Callable[..., Queue]) -> None:
    q = make_queue()
    if is_ring(q):
        with pytest.raises(ConfigurationError, match="cannot be delayed"):
            q.push("later", delay=1.0)
        assert q.stats().ready == 0
        return
    later = q.push("later", delay=1.0)
    now_id = q.push("now")
    assert [m.id for m in q.pop(10)] == [now_id]
    s = q.stats()
    assert (s.ready, s.delayed) == (0, 1)
    got = q.pop(10, wait=5.0, poll_interval=0.1)
    assert [m.id for m in got] == [later]


# -- at least once --------------------------------------------------------------------------------


def test_lease_hides_message_until_ack(make_queue: Callable[..., Queue]) -> None:
    q = make_queue()
    ids = q.push_batch(["a", "b", "c"])
    leased = q.pop(2, semantics="at-least-once")
    assert [m.id for m in leased] == ids[:2]
    assert all(m.lease_until is not None for m in leased)
    # One pop, one lease: its messages share its end, which lies ahead.
    assert len({m.lease_until for m in leased}) == 1
    assert leased[0].lease_until is not None and leased[0].lease_until > dt.datetime.now(dt.UTC)
    assert [m.id for m in q.pop(5, semantics="at-least-once")] == ids[2:]
    assert q.stats().in_flight == 3
    assert q.ack(leased) == 2
    s = q.stats()
    assert (s.in_flight, s.finished) == (1, kept(q, 2))


def test_ack_naming_a_message_twice_acks_it_once(make_queue: Callable[..., Queue]) -> None:
    q = make_queue()
    ids = q.push_batch(["a", "b", "c"])
    leased = q.pop(3, semantics="at-least-once")
    assert q.ack([*leased, leased[1], leased[0]]) == 3  # each receipt counts once
    s = q.stats()
    assert (s.in_flight, s.ready, s.finished) == (0, 0, kept(q, 3))
    assert q.pop(3, semantics="at-least-once") == [] and len(ids) == 3


def test_nack_redelivers_then_fails_after_max_attempts(make_queue: Callable[..., Queue]) -> None:
    q = make_queue(max_attempts=3, retry_backoff=0.0, retry_backoff_max=0.0)
    [mid] = q.push_batch([{"poison": True}])
    for attempt in (1, 2, 3):
        [m] = q.pop(1, semantics="at-least-once")
        assert (m.id, m.attempts) == (mid, attempt)
        q.nack([m], error=f"boom {attempt}")
    assert q.pop(1, semantics="at-least-once") == []
    s = q.stats()
    assert (s.ready, s.in_flight, s.failed) == (0, 0, 1)
    [f] = q.list_failed()
    assert (f.id, f.attempts, f.payload, f.last_error) == (mid, 3, {"poison": True}, "boom 3")
    if getattr(q, "group_name", "default") != "default":
        # a requeue pushes again, to every group of the ring: refused on a ring with groups
        with pytest.raises(ConfigurationError, match="every group"):
            q.requeue_failed()
        assert q.delete_failed() == 1 and q.stats().failed == 0
        return
    assert q.requeue_failed() == 1
    [m] = q.pop(1, semantics="at-least-once")
    # a ring pushes a requeued message again: its old number's slot may be reused, so it has a new id
    assert m.id > mid if is_ring(q) else m.id == mid, (m.id, mid)
    assert (m.attempts, m.payload) == (1, {"poison": True})
    q.nack([m], delay=0)
    [m] = q.pop(1, semantics="at-least-once")
    q.ack([m])
    assert q.stats().finished == kept(q, 1)


def test_nack_backoff_delays_redelivery(make_queue: Callable[..., Queue]) -> None:
    q = make_queue(retry_backoff=30.0)
    q.push("x")
    [m] = q.pop(1, semantics="at-least-once")
    q.nack([m])
    s = q.stats()
    assert (s.ready, s.delayed) == (0, 1)
    assert q.pop(1, semantics="at-least-once") == []


def test_expired_lease_is_reclaimed_and_delivered_once_more(
    make_queue: Callable[..., Queue], dbq: DbQueue
) -> None:
    q = make_queue()
    sent = list(range(20))
    q.push_batch(sent)
    first = q.pop(20, semantics="at-least-once")
    expire_leases(dbq, [m.id for m in first[:5]], q)
    assert q.reclaim_expired() == 5
    again = q.pop(20, semantics="at-least-once")
    assert sorted(m.id for m in again) == sorted(m.id for m in first[:5])
    assert all(m.attempts == 2 for m in again)
    # the first consumer's receipts for those five are now stale: its ack is refused, whole
    with pytest.raises(LeaseExpiredError) as err:
        q.ack(first)
    assert sorted(err.value.ids) == sorted(m.id for m in first[:5])
    assert "nothing in this call was acknowledged" in str(err.value)
    assert q.stats().in_flight == 20
    q.ack(first[5:])
    q.ack(again)
    s = q.stats()
    assert (s.in_flight, s.finished, s.ready) == (0, kept(q, 20), 0)


def test_ack_of_expired_lease_is_refused_and_changes_nothing(
    make_queue: Callable[..., Queue], dbq: DbQueue
) -> None:
    q = make_queue()
    q.push_batch(["a", "b"])
    leased = q.pop(2, semantics="at-least-once")
    expire_leases(dbq, [leased[0].id], q)
    with pytest.raises(LeaseExpiredError):
        q.ack(leased)
    with pytest.raises(LeaseExpiredError):
        q.nack(leased)
    assert q.stats().in_flight == 2
    assert q.ack([leased[1]]) == 1


def test_refused_ack_in_a_callers_transaction_leaves_it_usable(
    make_queue: Callable[..., Queue], dbq: DbQueue
) -> None:
    """A lost lease refuses the ack and changes nothing, and the caller's transaction goes on."""
    q = make_queue()
    payloads = ["a", "b", "c"]
    q.push_batch(payloads)
    leased = q.pop(3, semantics="at-least-once")
    expire_leases(dbq, [leased[0].id], q)
    with dbq.transaction() as conn:
        with pytest.raises(LeaseExpiredError) as refused:
            q.ack(leased, conn=conn)
        assert refused.value.ids == [leased[0].id]
        assert q.ack([leased[1]], conn=conn) == 1  # the same transaction goes on
    with pytest.raises(RuntimeError), dbq.transaction() as conn:  # and a rollback undoes an ack
        assert q.ack([leased[2]], conn=conn) == 1
        raise RuntimeError("the caller's work failed")
    assert q.ack([leased[2]]) == 1
    assert q.reclaim_expired() == 1
    again = q.pop(3, semantics="at-least-once")
    assert [m.id for m in again] == [leased[0].id]
    assert q.ack(again) == 1
    finished = [leased[1], leased[2], *again]
    assert checksum(m.payload for m in finished) == checksum(payloads)
    s = q.stats()
    assert (s.ready, s.in_flight, s.finished) == (0, 0, kept(q, 3))


def test_refused_ack_on_an_idle_connection_leaves_it_usable(
    make_queue: Callable[..., Queue], dbq: DbQueue
) -> None:
    """An ack on a caller's own fresh connection without autocommit: refused whole, connection usable."""
    q = make_queue()
    payloads = ["a", "b"]
    q.push_batch(payloads)
    leased = q.pop(2, semantics="at-least-once")
    expire_leases(dbq, [leased[1].id], q)
    with callers_connection(dbq) as conn:
        with pytest.raises(LeaseExpiredError) as refused:
            q.ack(leased, conn=conn)
        assert refused.value.ids == [leased[1].id]
        assert q.ack([leased[0]], conn=conn) == 1
        conn.commit()
    s = q.stats()
    assert (s.in_flight, s.finished) == (1, kept(q, 1))
    assert q.reclaim_expired() == 1
    again = q.pop(2, semantics="at-least-once")
    assert [(m.id, m.attempts) for m in again] == [(leased[1].id, 2)]
    assert q.ack(again) == 1
    assert checksum(m.payload for m in [leased[0], *again]) == checksum(payloads)
    s = q.stats()
    assert (s.ready, s.in_flight, s.finished) == (0, 0, kept(q, 2))


def test_expired_leases_reclaimed_by_pop_itself(make_queue: Callable[..., Queue]) -> None:
    q = make_queue(visibility_timeout=0.2)
    q.push("x")
    [m] = q.pop(1, semantics="at-least-once")
    time.sleep(0.4)
    got = q.pop(1, semantics="at-least-once", wait=5.0, poll_interval=0.1)
    assert [(g.id, g.attempts) for g in got] == [(m.id, 2)]


def test_peek_and_readiness_name_each_message_with_its_deliveries_so_far(
    make_queue: Callable[..., Queue],
) -> None:
    """peek() shows each ready message with its attempts and deliveries so far: 0 and 0 for one never
    delivered, 1 and 1 for one nacked back; readiness() counts them and names as its head the message a
    pop takes first, which peek() shows first."""
    q = make_queue(retry_backoff=0)
    sent = ["a", "b", "c"]
    ids = q.push_batch(sent)
    assert [(m.id, m.attempts, m.delivery) for m in q.peek(10)] == [(i, 0, 0) for i in ids]
    assert q.readiness() == (3, (ids[0], 0)) and q.count_ready() == 3
    [m] = q.pop(1, semantics="at-least-once")
    assert q.nack([m], delay=0) == 1
    peeked = q.peek(10)
    assert {x.id: (x.attempts, x.delivery) for x in peeked} == {
        ids[0]: (1, 1),
        ids[1]: (0, 0),
        ids[2]: (0, 0),
    }
    assert q.readiness() == (3, peeked[0].receipt)
    got = drain(q, "at-least-once")
    assert sorted(x.id for x in got) == ids and checksum(x.payload for x in got) == checksum(sent)
    assert [x.delivery for x in got if x.id == ids[0]] == [2]
    assert q.readiness() == (0, None) and q.peek() == []


def test_a_lease_past_its_end_is_ready_at_once_and_in_flight_until_reclaimed(
    make_queue: Callable[..., Queue], dbq: DbQueue
) -> None:
    """A consumer died holding its lease: once its end passed, count_ready() and readiness() (what a
    sensor and a trigger wait on) count its messages at once, before any pop or maintenance reclaimed
    them (a pop reclaims them first), its first message the head, delivered once; stats() and peek()
    show them in flight until then. Out of attempts, they are not counted."""
    q = make_queue(max_attempts=3)
    spent = make_queue(max_attempts=1)
    sent = [f"m{i}" for i in range(5)]
    ids = q.push_batch(sent)
    spent.push_batch(sent)
    held = q.pop(5, semantics="at-least-once")
    lost = spent.pop(5, semantics="at-least-once")
    assert q.readiness() == (0, None)
    expire_leases(dbq, ids, q)
    expire_leases(dbq, [m.id for m in lost], spent)
    assert q.count_ready() == 5 and q.readiness() == (5, (ids[0], 1)) and q.count_ready(cap=2) == 2
    assert (q.stats().ready, q.stats().in_flight) == (0, 5) and q.peek() == []
    assert spent.count_ready() == 0 and spent.readiness() == (0, None)
    assert q.reclaim_expired() == 5 and spent.reclaim_expired() == 5  # what a pop does first
    assert q.readiness() == (5, (ids[0], 1)) and q.stats().ready == 5
    again = q.pop(5, semantics="at-least-once")
    assert [(m.id, m.delivery) for m in again] == [(i, 2) for i in ids] and q.ack(again) == 5
    assert checksum(m.payload for m in again) == checksum(m.payload for m in held) == checksum(sent)
    assert spent.pop(5) == [] and spent.stats().failed == 5
    assert checksum(f.payload for f in spent.list_failed()) == checksum(sent)


def test_lease_expiry_after_max_attempts_fails_the_message(
    make_queue: Callable[..., Queue], dbq: DbQueue
) -> None:
    q = make_queue(max_attempts=1)
    q.push("x")
    [m] = q.pop(1, semantics="at-least-once")
    expire_leases(dbq, [m.id], q)
    q.reclaim_expired()
    s = q.stats()
    assert (s.ready, s.in_flight, s.failed) == (0, 0, 1)
    [f] = q.list_failed()
    assert "lease expired" in (f.last_error or "")
    assert q.delete_failed([f.id]) == 1
    assert q.stats().failed == 0


# -- exactly once ---------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["pop", "pop_payloads"])
def test_exactly_once_commits_or_rolls_back_with_the_callers_work(
    make_queue: Callable[..., Queue], dbq: DbQueue, api: str
) -> None:
    q = make_queue()
    sent = [{"n": i} for i in range(250)]
    q.push_batch(sent)
    RESULTS.create(dbq)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), dbq.transaction() as conn:
        assert len(pop_exactly_once(dbq, q, api, 100, conn)) == 100
        raise Boom
    assert q.stats().ready == 250  # rolled back: still queued, and nothing written
    assert read_results(dbq) == []

    while True:
        with dbq.transaction() as conn:
            if not pop_exactly_once(dbq, q, api, 60, conn):
                break
    results = read_results(dbq)
    assert checksum({"n": n} for n in results) == checksum(sent)
    assert q.stats().ready == 0


def test_exactly_once_requires_a_transaction(make_queue: Callable[..., Queue]) -> None:
    q = make_queue()
    q.push("x")
    with pytest.raises(TransactionRequiredError):
        q.pop(1, semantics="exactly-once")
    assert q.stats().ready == 1


# -- payloads only --------------------------------------------------------------------------------


def recorded_statements(q: Queue, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the name of every named query ``q``'s pops fetch (the dialect's ``fetchall``, called through
    unchanged)."""
    names: list[str] = []
    fetchall = q._db.fetchall

    def recorded(name: str, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        names.append(name)
        return fetchall(name, *args, **kwargs)

    monkeypatch.setattr(q._db, "fetchall", recorded)
    return names


@pytest.mark.parametrize(
    ("payload_type", "make_payload"),
    [
        ("json", lambda i: {"n": i, "pad": "é✓" * (i % 700)}),
        ("bytes", lambda i: i.to_bytes(4, "big") * (1 + i % 900)),
    ],
)
def test_pop_payloads_returns_what_pop_would_in_its_order(
    make_queue: Callable[..., Queue],
    dbq: DbQueue,
    monkeypatch: pytest.MonkeyPatch,
    payload_type: str,
    make_payload: Callable[[int], Any],
) -> None:
    """Two queues get the same pushes (priorities where the design has them; payloads up to 3.6 KB, so
    the table design keeps some in ``data``); one is drained by pop, the other by pop_payloads, in
    batches of 1, 7 and 100: the payloads come back alike, in the same order, each once. On PostgreSQL
    the batches of payloads come from the statements that send one column a message."""
    a = make_queue(payload_type=payload_type, max_payload_bytes=4000)
    b = make_queue(payload_type=payload_type, max_payload_bytes=4000)
    sent = [make_payload(i) for i in range(600)]
    for q in (a, b):
        for k in range(0, 600, 150):
            if is_ring(q):
                q.push_batch(sent[k : k + 150])
            else:
                q.push_batch(sent[k : k + 150], priority=k % 300)
    if not is_ring(b):
        assert count_payloads(dbq, b.settings.queue_id)[1] > 0  # the larger payloads are in data
    names = recorded_statements(b, monkeypatch)
    by_pop: list[Any] = []
    by_payloads: list[Any] = []
    for n in [1, 7, 100] * 20:
        by_pop += [m.payload for m in a.pop(n)]
        got = b.pop_payloads(n)
        assert len(got) <= n
        by_payloads += got
    assert a.pop(1) == [] and b.pop_payloads(1) == []
    assert by_payloads == by_pop
    assert len(by_payloads) == 600
    if payload_type == "json":
        assert checksum(by_payloads) == checksum(sent)
    else:
        assert sorted(by_payloads) == sorted(sent)
    if dbq.dialect == "postgresql":
        fast = (
            "ring_rows_pop_payloads"
            if is_rows(b)
            else "ring_take_payloads"
            if is_ring(b)
            else "pop_take_payloads"
        )
        assert fast in names
    for q in (a, b):
        s = q.stats()
        assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 0, 0, 0)
        assert s.finished == kept(q, 600)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"semantics": "at-least-once"}, ConfigurationError, "no receipts to ack"),
        ({"semantics": "exactly-once"}, TransactionRequiredError, "exactly-once pop needs"),
        ({"n": 0}, ConfigurationError, "batch size"),
        ({"wait": -1}, ConfigurationError, "wait"),
        ({"semantics": "twice"}, ConfigurationError, "twice"),
    ],
)
def test_pop_payloads_refuses_what_it_cannot_do_and_takes_nothing(
    make_queue: Callable[..., Queue], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    q = make_queue()
    q.push_batch(["x", "y"])
    with pytest.raises(error, match=match):
        q.pop_payloads(**kwargs)
    s = q.stats()
    assert (s.ready, s.in_flight) == (2, 0)
    assert q.pop_payloads(5) == ["x", "y"]


def test_pop_payloads_waits_for_a_push(make_queue: Callable[..., Queue]) -> None:
    q = make_queue(notify="never")
    result: list[Any] = []
    errors: list[str] = []

    def waiter() -> None:
        try:
            result.extend(q.pop_payloads(10, wait=30.0, poll_interval=0.1))
        except BaseException:
            errors.append(traceback.format_exc())

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.3)
    q.push_batch([{"late": 1}, {"late": 2}])
    t.join(timeout=40)
    assert not t.is_alive() and not errors, errors
    assert result == [{"late": 1}, {"late": 2}]
    assert q.stats().ready == 0
    t0 = time.monotonic()
    assert q.pop_payloads(1, wait=0.3, poll_interval=0.1) == []
    assert time.monotonic() - t0 >= 0.3


# -- concurrency basics ---------------------------------------------------------------------------


def test_concurrent_consumers_never_share_a_message(make_queue: Callable[..., Queue]) -> None:
    """Four threads pop one queue, two at most once and two at least once (acking every batch): each
    message reaches exactly one of them, is counted only once its pop (or its ack) returned, no thread
    fails or hangs, and the queue ends with nothing ready, delayed, in flight or failed."""
    q = make_queue()
    sent = list(range(3000))
    ids = q.push_batch(sent)
    got: list[list[Message]] = [[] for _ in range(4)]
    errors: list[str] = []

    def consume(k: int) -> None:
        try:
            while batch := q.pop(25, semantics="at-least-once" if k % 2 else "at-most-once"):
                if k % 2:
                    assert q.ack(batch) == len(batch)
                got[k].extend(batch)  # finished: popped at most once, or acknowledged
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not [t.name for t in threads if t.is_alive()], "a consumer was still popping after 120 s"
    assert not errors, errors[0]
    allgot = [m for g in got for m in g]
    assert sorted(m.id for m in allgot) == sorted(ids)  # every message, and none twice
    assert checksum(m.payload for m in allgot) == checksum(sent)
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 0, 0, 0), s


# -- waiting pop ----------------------------------------------------------------------------------

WAKE_WAIT_S = 20.0
"""How long a waiting pop of the NOTIFY tests waits. Its poll interval is three times that, so without a
NOTIFY it would claim again only when its wait runs out; a wake-up within half of it is the NOTIFY's."""


def record_claims(q: Queue, monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """Record ``(monotonic time it returned, messages claimed)`` of every claim ``q`` makes while a pop
    waits (the engine's ``_pop_once``, called through unchanged), and ``(time, 0)`` for every look of a
    waiting pop that made no claim because its question told it there was nothing to claim (a ring of
    the rows layout whose every row issued is taken: ``_look``, called through unchanged)."""
    claims: list[tuple[float, int]] = []
    claim = q._pop_once
    look = q._look

    def recorded(*args: Any, **kwargs: Any) -> list[Message]:
        msgs = claim(*args, **kwargs)
        claims.append((time.monotonic(), len(msgs)))
        return msgs

    def looked(take: Callable[[], list[Any]]) -> tuple[bool, list[Any]]:
        took: list[bool] = []

        def counted() -> list[Any]:
            took.append(True)
            return take()

        pushing, got = look(counted)
        if not took:
            claims.append((time.monotonic(), 0))
        return pushing, got

    monkeypatch.setattr(q, "_pop_once", recorded)
    monkeypatch.setattr(q, "_look", looked)
    return claims


def start_waiting_pop(q: Queue, **kwargs: Any) -> tuple[threading.Thread, list[Message], list[str]]:
    """Start ``q.pop(1, **kwargs)`` in a thread; return it, what the pop returns, and its errors."""
    result: list[Message] = []
    errors: list[str] = []

    def waiter() -> None:
        try:
            result.extend(q.pop(1, **kwargs))
        except BaseException:
            errors.append(traceback.format_exc())

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    return t, result, errors


def wait_for_claims(claims: list[tuple[float, int]], n: int) -> None:
    deadline = time.monotonic() + 10
    while len(claims) < n:
        assert time.monotonic() < deadline, f"the waiting pop made {len(claims)} claims, not {n}"
        time.sleep(0.005)


@pytest.mark.parametrize("notify", ["auto", "always"])
def test_waiting_pop_is_woken_by_notify(
    make_queue: Callable[..., Queue], dbq: DbQueue, notify: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pop claims, LISTENs, claims again (or, on a rows ring, asks and is told there is nothing to
    claim) and then waits; the push comes after both came back empty, so only a claim after the wait can
    find it, and only a NOTIFY ends that wait early."""
    postgres_only(dbq, "SQL Server has no NOTIFY (the polling test below runs there)")
    q = make_queue(notify=notify)
    claims = record_claims(q, monkeypatch)
    t, result, errors = start_waiting_pop(q, wait=WAKE_WAIT_S, poll_interval=3 * WAKE_WAIT_S)
    wait_for_claims(claims, 2)
    pushed_at = time.monotonic()
    pushed = q.push({"wake": notify})
    t.join(timeout=WAKE_WAIT_S + 10)
    assert not t.is_alive() and not errors, errors
    assert [m.id for m in result] == [pushed]
    [(_, before), (_, listening), (woke_at, found)] = claims
    assert (before, listening, found) == (0, 0, 1)
    assert woke_at - pushed_at < WAKE_WAIT_S / 2, (
        f"the pop found the message {woke_at - pushed_at:.1f} s after the push: its wait ran out, "
        "no NOTIFY woke it"
    )
    s = q.stats()
    assert (s.ready, s.in_flight) == (0, 0)


def test_waiting_pop_finds_a_push_by_polling(
    make_queue: Callable[..., Queue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without NOTIFY (notify="never", and SQL Server) a waiting pop finds a later push by claiming again."""
    q = make_queue(notify="never")
    claims = record_claims(q, monkeypatch)
    t, result, errors = start_waiting_pop(q, wait=30.0, poll_interval=0.2)
    wait_for_claims(claims, 1)
    pushed = q.push({"wake": "poll"})
    t.join(timeout=40)
    assert not t.is_alive() and not errors, errors
    assert [m.id for m in result] == [pushed]
    assert claims[0][1] == 0 and claims[-1][1] == 1 and len(claims) >= 2  # found by a later claim
    assert q.stats().ready == 0


def test_waiting_pop_times_out_empty(make_queue: Callable[..., Queue]) -> None:
    q = make_queue()
    t0 = time.monotonic()
    assert q.pop(1, wait=0.5, poll_interval=0.1) == []
    assert time.monotonic() - t0 >= 0.5


# -- queues and validation ------------------------------------------------------------------------


def test_many_queues_in_one_schema_are_isolated(make_queue: Callable[..., Queue]) -> None:
    a, b = make_queue(), make_queue()
    a.push_batch(["a1", "a2"])
    b.push_batch(["b1"])
    assert [m.payload for m in b.pop(10)] == ["b1"]
    assert [m.payload for m in a.pop(10)] == ["a1", "a2"]


@pytest.mark.own_schema  # the list of queues
def test_create_queue_is_idempotent_and_checks_settings(client: DbQueue, dbq: DbQueue) -> None:
    q1 = client.create_queue("orders", max_attempts=4)
    q2 = client.create_queue("orders", max_attempts=4)
    assert q1.settings == q2.settings
    with pytest.raises(QueueExistsError, match="max_attempts"):
        client.create_queue("orders", max_attempts=7)
    with pytest.raises(QueueExistsError):
        client.create_queue("orders", max_attempts=4, exist_ok=False)
    assert [s.name for s in client.list_queues()] == ["orders"]


@pytest.mark.own_schema  # every queue's payloads
def test_drop_queue_removes_everything(client: DbQueue, dbq: DbQueue) -> None:
    """Every row of the dropped queue goes (its payloads too, small ones in their rows and large ones in
    data); another queue's stay, whole."""
    q = client.create_queue("tmp")
    other = client.create_queue("other")
    kept_payloads = ["k1", "k2" * 1000]
    other.push_batch(kept_payloads)
    big = "b" * 2000
    q.push_batch([1, big, 3, big])
    assert [m.payload for m in q.pop(1)] == [1]
    [late] = q.pop(1, semantics="at-least-once")
    q.ack([late])  # one popped, one finished (kept for the archiver), two still queued
    queue_id = q.settings.queue_id
    assert count_rows(dbq, "meta", queue_id) == 2
    assert count_rows(dbq, "done", queue_id) == kept(q, 2)
    # small payloads in their rows (1 of the other queue, 3 and 1 if kept), large ones in data
    assert count_payloads(dbq) == (2 + kept(q, 1), 2 + kept(q, 1))
    assert client.drop_queue("tmp")
    with pytest.raises(QueueNotFoundError):
        client.queue("tmp")
    assert client.drop_queue("tmp", missing_ok=True) is False
    for table in ("meta", "done", "archive", "batches"):
        assert count_rows(dbq, table, queue_id) == 0, table
    assert count_payloads(dbq) == (1, 1)  # the other queue's payloads only
    assert checksum(m.payload for m in drain(other)) == checksum(kept_payloads)


def test_unknown_queue_is_named(client: DbQueue) -> None:
    with pytest.raises(QueueNotFoundError, match=r"queue 'nope' does not exist in schema"):
        client.queue("nope")


@pytest.mark.parametrize("bad", ["", "Orders", "1abc", "a-b", "x" * 49, "pg_x", "a;drop table x", None])
def test_bad_queue_names_are_refused(client: DbQueue, bad: Any) -> None:
    with pytest.raises(InvalidNameError):
        client.create_queue(bad)


def test_bad_payload_fails_the_whole_batch(make_queue: Callable[..., Queue]) -> None:
    q = make_queue(max_payload_bytes=100)
    with pytest.raises(PayloadTypeError, match=r"payload #2 is not JSON-serialisable"):
        q.push_batch([1, 2, {3}, 4])
    with pytest.raises(PayloadTooLargeError, match=r"payload #1 is 202 bytes .* limit .* is 100"):
        q.push_batch(["ok", "x" * 200])
    with pytest.raises(PayloadTypeError, match="bytes"):
        q.push(b"raw")
    assert q.stats().ready == 0
    bq = make_queue(payload_type="bytes")
    with pytest.raises(PayloadTypeError, match="takes bytes payloads; payload #0 is str"):
        bq.push("text")


@pytest.mark.parametrize(
    "kwargs", [{"n": 0}, {"n": -1}, {"semantics": "twice"}, {"visibility_timeout": 0}, {"n": 1.5}]
)
def test_bad_pop_arguments(make_queue: Callable[..., Queue], kwargs: dict[str, Any]) -> None:
    q = make_queue()
    q.push("x")
    with pytest.raises(ConfigurationError):
        q.pop(**kwargs)
    assert q.stats().ready == 1


def test_semantics_parse() -> None:
    assert Semantics.parse("at_least_once") is Semantics.AT_LEAST_ONCE
    assert Semantics.parse(Semantics.EXACTLY_ONCE) is Semantics.EXACTLY_ONCE


def _notifications(dbq: DbQueue, q: Queue, action: Callable[[], object], *, waiting: bool = False) -> int:
    """Run ``action`` and count the NOTIFYs a listener on the queue's channel receives. ``waiting``: the
    listener also holds the queue's waiters' lock shared, as the listening connection of a process with
    a waiting pop does (the table design's notify="auto" asks that lock who waits)."""
    channel = dbq.db.channel(q.settings.queue_id)
    # A LISTEN needs a session of its own: the listen DSN when the engine has one (behind a transaction
    # pooler), else the engine's own.
    dsn = getattr(dbq.db, "listen_dsn", None) or dbq.db.dsn
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
        lock = dbq.db.waiters_lock(channel) if waiting else None  # type: ignore[attr-defined]
        if lock:
            assert c.execute(lock[0], lock[2]).fetchone() == (True,)
        action()
        got = notified_so_far(c, dsn, channel)
        if lock:  # at once: a closed session's locks go only when its server process has ended
            c.execute(lock[1], lock[2])
        return got


def test_auto_notify_only_when_the_queue_was_empty(make_queue: Callable[..., Queue], dbq: DbQueue) -> None:
    """A ring's notify="auto" push notifies when its consumers had caught up (the queue was empty to
    them); the table design's asks who waits instead: while a waiter's listening connection holds the
    queue's waiters' lock every push that makes a message ready notifies, and without one none does."""
    postgres_only(dbq, "SQL Server has no NOTIFY")
    q = make_queue(notify="auto")
    if is_ring(q):
        assert _notifications(dbq, q, lambda: q.push("first")) == 1
        assert _notifications(dbq, q, lambda: q.push_batch(["second", "third"])) == 0  # busy: no NOTIFY
        with pytest.raises(ConfigurationError):  # (a ring has no delayed pushes)
            q.push("delayed", delay=60)
        drain(q)
        assert _notifications(dbq, q, lambda: q.push("again")) == 1
    else:
        assert _notifications(dbq, q, lambda: q.push("first")) == 0  # nobody waits: no NOTIFY
        drain(q)
        assert _notifications(dbq, q, lambda: q.push("first"), waiting=True) == 1
        assert _notifications(dbq, q, lambda: q.push_batch(["second", "third"]), waiting=True) == 1
        assert _notifications(dbq, q, lambda: q.push("delayed", delay=60), waiting=True) == 0  # not ready
        assert _notifications(dbq, q, lambda: q.push_batch(["fourth"])) == 0
        drain(q)
        assert _notifications(dbq, q, lambda: q.push("again"), waiting=True) == 1
    always = make_queue(notify="always")
    always.push("x")
    assert _notifications(dbq, always, lambda: always.push("y")) == 1
    never = make_queue(notify="never")
    assert _notifications(dbq, never, lambda: never.push("z")) == 0


def test_nack_backoff_doubles_and_is_capped(client: DbQueue, dbq: DbQueue) -> None:
    """The default nack delay is retry_backoff * 2^(attempts-1), capped at retry_backoff_max."""
    q = client.create_queue(
        "backoff", design="table", max_attempts=10, retry_backoff=100.0, retry_backoff_max=350.0
    )
    [mid] = q.push_batch(["x"])
    delays = []
    for attempt in range(1, 5):
        make_due_now(dbq, mid)  # as if its backoff had passed
        [m] = q.pop(1, semantics="at-least-once")
        assert (m.id, m.attempts, m.payload) == (mid, attempt, "x")
        q.nack([m])
        delays.append(round(due_in(dbq, mid) / 10) * 10)  # seconds, to the nearest 10
    assert delays == [100, 200, 350, 350]
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight) == (0, 1, 0)


# -- deduplication keys, expiry and ordering per key (the table design) ---------------------------

OPTION_SQL = {
    "postgresql": {
        "age_keys": "UPDATE {schema}.dedup SET pushed_at = now() - make_interval(secs => %(age)s) "
        "WHERE queue_id = %(queue_id)s",
        "expire_now": "UPDATE {schema}.meta_opt SET expires_at = now() - interval '1 second' "
        "WHERE queue_id = %(queue_id)s AND id = ANY (%(ids)s)",
    },
    "mssql": {
        "age_keys": "UPDATE {schema}.dedup "
        "SET pushed_at = DATEADD(millisecond, -CAST(%(age)s * 1000 AS int), SYSUTCDATETIME()) "
        "WHERE queue_id = %(queue_id)s",
        "expire_now": "UPDATE {schema}.meta_opt SET expires_at = DATEADD(second, -1, SYSUTCDATETIME()) "
        "WHERE queue_id = %(queue_id)s AND id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s))",
    },
}
"""The options tests' own writes, one text per dialect: the age of a queue's deduplication keys, and
messages made expired (their expiry a second ago, by the server's clock)."""


def test_dedup_keys_map_pushes_to_the_first_message_of_their_key(dbq: DbQueue) -> None:
    """A second push of a key pushes nothing and returns the first push's id, alone or in a batch (a
    key repeated in a batch too); keys are compared character by character (case, accents and characters
    outside the BMP), up to the longest a key may be."""
    from airflow_dbqueue.engine.queue import MAX_DEDUP_KEY_CHARS

    q = dbq.create_queue("dk")
    long_key = "🙂" * MAX_DEDUP_KEY_CHARS  # two UTF-16 code units a character on SQL Server
    first = q.push({"o": 1}, dedup_key="k1")
    assert q.push({"o": 1, "retry": True}, dedup_key="k1") == first
    ids = q.push_batch(
        [{"o": 2}, {"o": 1}, {"o": 3}, {"o": 2}, {"o": 4}, {"o": 5}, {"o": 6}],
        dedup_keys=["k2", "k1", "K1", "k2", "ké", "ke", long_key],
    )
    assert ids[1] == first and ids[3] == ids[0] and len({first, *ids}) == 6
    assert q.push({"o": 6}, dedup_key=long_key) == ids[6]
    assert count_rows(dbq, "dedup", q.settings.queue_id) == 6
    got = drain(q)
    assert sorted(m.id for m in got) == sorted({first, *ids})
    assert checksum(m.payload for m in got) == checksum([{"o": i} for i in range(1, 7)])
    assert q.push({"o": 1, "late": True}, dedup_key="k1") == first  # consumed since: still within the window
    assert q.pop(10) == []


def test_dedup_window_and_the_upkeep_that_forgets_keys(dbq: DbQueue) -> None:
    """Within the window a key pushes nothing; past it a push of the key is new (and takes the key
    over); the upkeep forgets keys older than the window, and a dropped queue its keys."""
    q = dbq.create_queue("dw", dedup_window=60)
    qid = q.settings.queue_id
    first = q.push("a", dedup_key="k")
    run_sql(dbq, OPTION_SQL[dbq.dialect]["age_keys"], {"age": 50.0, "queue_id": qid})
    assert q.push("a again", dedup_key="k") == first
    run_sql(dbq, OPTION_SQL[dbq.dialect]["age_keys"], {"age": 70.0, "queue_id": qid})
    second = q.push("b", dedup_key="k")
    assert second != first and q.push("b again", dedup_key="k") == second
    assert q.maintain()["keys_forgotten"] == 0
    run_sql(dbq, OPTION_SQL[dbq.dialect]["age_keys"], {"age": 70.0, "queue_id": qid})
    assert q.maintain()["keys_forgotten"] == 1 and count_rows(dbq, "dedup", qid) == 0
    assert checksum(m.payload for m in drain(q)) == checksum(["a", "b"])
    q.push("c", dedup_key="k")
    dbq.drop_queue("dw")
    assert count_rows(dbq, "dedup", qid) == 0 and count_rows(dbq, "meta", qid) == 0


@pytest.mark.parametrize("first_commits", [True, False])
def test_a_racing_push_of_a_key_waits_for_the_first(dbq: DbQueue, first_commits: bool) -> None:
    """Two pushes of one key in separate transactions: the second waits for the first's transaction, then
    gets its id (it committed) or pushes its own message (it rolled back). One message either way."""
    q = dbq.create_queue("dr")
    got: dict[str, Any] = {}

    def second() -> None:
        try:
            got["id"] = q.push("second", dedup_key="r")
        except Exception as exc:  # reported below
            got["error"] = exc

    class Abort(Exception):
        pass

    with contextlib.suppress(Abort), dbq.transaction() as conn:
        first = q.push("first", dedup_key="r", conn=conn)
        t = threading.Thread(target=second)
        t.start()
        t.join(0.5)
        assert t.is_alive(), got  # waiting for the first push's transaction
        if not first_commits:
            raise Abort
    t.join(30)
    assert not t.is_alive() and "error" not in got, got
    assert (got["id"] == first) is first_commits
    [m] = drain(q)
    assert (m.id, m.payload) == (got["id"], "first" if first_commits else "second")


def test_expired_messages_are_never_handed_out_and_fail(dbq: DbQueue) -> None:
    """No pop, claim, peek or count takes or shows an expired message before a sweep; the sweep fails
    it (last_error "expired", counted in stats), and a requeue delivers it after all."""
    q = dbq.create_queue("ex", ttl=3600)
    q.reclaim_every = 3600  # type: ignore[attr-defined]  # keep the pops' own sweep from running
    q._last_reclaim = time.monotonic()  # type: ignore[attr-defined]
    ids = q.push_batch([f"m{i}" for i in range(6)] + [{"big": "y" * 5000}])
    doomed = [ids[1], ids[3], ids[6]]
    run_sql(dbq, OPTION_SQL[dbq.dialect]["expire_now"], {"queue_id": q.settings.queue_id, "ids": doomed})
    assert q.count_ready() == 4 and [m.id for m in q.peek(10)] == [ids[0], ids[2], ids[4], ids[5]]
    [leased] = q.pop(1, semantics="at-least-once")
    batch = q.claim_batch(10)
    assert batch is not None and [i for i, _ in batch.receipts] == [ids[2], ids[4], ids[5]]
    assert q.pop(10) == []
    assert q.maintain()["expired"] == 3
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed, st.extra.get("expired")) == (0, 4, 3, 3)
    assert sorted((f.id, f.last_error) for f in q.list_failed()) == [(i, "expired") for i in doomed]
    assert q.ack([leased]) == 1 and q.ack_batch(batch.batch_id) == 3
    assert q.requeue_failed() == 3
    again = drain(q)
    assert sorted(m.id for m in again) == doomed
    assert checksum(m.payload for m in again) == checksum(["m1", "m3", {"big": "y" * 5000}])
    assert count_rows(dbq, "meta_opt", q.settings.queue_id) == 0


@pytest.mark.own_schema  # every queue's payloads
@pytest.mark.parametrize("archive", [False, True])
def test_expired_messages_of_a_dropping_queue_go(dbq: DbQueue, archive: bool) -> None:
    q = dbq.create_queue("exd", ttl=3600, on_expiry="drop", archive=archive)
    ids = q.push_batch([f"x{i}" for i in range(4)] + [{"big": "y" * 5000}])
    run_sql(dbq, OPTION_SQL[dbq.dialect]["expire_now"], {"queue_id": q.settings.queue_id, "ids": ids[2:]})
    assert q.maintain()["expired"] == 3
    st = q.stats()
    assert (st.ready, st.failed, st.finished) == (2, 0, kept(q, 3))
    assert checksum(m.payload for m in drain(q)) == checksum(["x0", "x1"])
    assert count_rows(dbq, "meta_opt", q.settings.queue_id) == 0
    assert count_payloads(dbq)[1] == (1 if archive else 0)  # the large payload went with its message


def test_a_keys_messages_are_handed_out_one_at_a_time_in_push_order(dbq: DbQueue) -> None:
    """Ordering per key: no message of a key while an earlier one is ready or in flight; a nack brings
    it back first; keys do not hold each other back; a batch claims only the head of each key."""
    q = dbq.create_queue("ok", ordering="per_key", retry_backoff=0, max_attempts=10)
    q.push_batch(["a1", "a2", "a3"], keys=["a", "a", "a"])
    q.push_batch(["b1", "x", "b2"], keys=["b", None, "b"])  # x has no key: ordered with nothing
    q.push("a4", key="a")
    first = q.pop(10, semantics="at-least-once")
    assert [m.payload for m in first] == ["a1", "b1", "x"]
    assert q.pop(10, semantics="at-least-once") == []  # every key's head is in flight
    assert q.count_ready() == 0 and q.peek(10) == []
    a1, b1, x = first
    assert q.nack([b1], delay=0) == 1  # back first: b2 still waits for it
    assert q.ack([a1, x]) == 2
    batch = q.claim_batch(10)
    assert batch is not None and [i for i, _ in batch.receipts] == [m.id for m in q.leased(batch.receipts)]
    second = q.leased(batch.receipts)
    assert [m.payload for m in second] == ["a2", "b1"]
    assert q.ack_batch(batch.batch_id) == 2
    rest = drain(q, "at-least-once")
    assert [m.payload for m in rest] == ["a3", "b2", "a4"]
    got = [m.payload for m in [a1, x, *second, *rest]]
    assert checksum(got) == checksum(["a1", "a2", "a3", "a4", "b1", "b2", "x"])
    assert count_rows(dbq, "meta_opt", q.settings.queue_id) == 0
