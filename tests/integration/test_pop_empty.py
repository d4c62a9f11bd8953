"""What a pop's empty answer means: nothing was ready that it could take, not that a lock was busy.

A pop that does not wait and runs outside a caller's transaction returns ``[]`` only when no message was
ready that some other transaction was not taking: a lock that another pop, a caller's transaction or a
maintenance step holds past the pop's own lock timeout (1 s) is waited out (up to the handle's
``lane_timeout``), and a lane that another pop holds is waited for even when the free lanes are empty.
Each test makes one such moment on purpose (a caller's transaction holds the lanes, or a test's
connection holds a table lock as a rotation or a compaction does), lets the pop start waiting, holds the
lock past 1 s, releases it, and checks that the pop returned the messages left, counted and checksummed.

PostgreSQL only: the tests watch the waiting pop in ``pg_stat_activity``. Each runs on the synchronous
and the asyncio face (the popping side; the holder is a caller's transaction of the synchronous one).
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from tests.dialects import dialect_dbq, postgres_only  # noqa: F401 - dialect_dbq is the fixture "dbq"
from tests.faces import FACES, faced
from tests.helpers import checksum

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from airflow_dbqueue.engine import DbQueue, Message, Queue

pytestmark = pytest.mark.integration

LAYOUTS = ["slots", "rows"]
HOLD_PAST_S = 1.3
"""How long a lock stays held once the pop waits for it: past the pop's own 1 s lock timeout."""


@pytest.fixture(params=FACES)
def client(request: pytest.FixtureRequest, dbq: DbQueue) -> Iterator[Any]:
    postgres_only(dbq, "the tests watch the waiting pop in pg_stat_activity")
    yield from faced(request, dbq)


class Popper:
    """One pop of ``q`` in a thread of its own: what it returned, or the error it raised, and when."""

    def __init__(self, q: Any, n: int) -> None:
        self.got: list[Message] | None = None
        self.error: str | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(q, n), daemon=True)
        self._thread.start()

    def _run(self, q: Any, n: int) -> None:
        t0 = time.monotonic()
        try:
            self.got = q.pop(n)
        except BaseException:
            self.error = traceback.format_exc()
        self.seconds = time.monotonic() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 60.0) -> list[Message]:
        self._thread.join(timeout)
        assert self.done(), f"the pop was still running after {timeout} s"
        assert self.error is None, self.error
        assert self.got is not None
        return self.got


def wait_until_waiting(dbq: DbQueue, popper: Popper, kinds: tuple[str, ...], timeout: float = 30.0) -> bool:
    """Wait until some backend of the test's database waits for a lock of one of ``kinds`` (the
    ``wait_event`` of ``pg_stat_activity``: ``advisory``, ``transactionid``, ``tuple``, ``relation``),
    or the pop finished; return whether one waits."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dbq.db.dsn, autocommit=True) as watch:
        while time.monotonic() < deadline and not popper.done():
            row = watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND wait_event = ANY (%s)",
                [list(kinds)],
            ).fetchone()
            if row and row[0]:
                return True
            time.sleep(0.01)
    return False


@contextlib.contextmanager
def callers_connection(dbq: DbQueue) -> Iterator[psycopg.Connection[Any]]:
    """A connection of the caller's own (autocommit off): its first statement opens the transaction that
    the test commits; closed on exit."""
    with psycopg.connect(dbq.db.dsn) as conn:
        yield conn


def ring(client: Any, name: str, layout: str, **settings: Any) -> Queue:
    return client.create_queue(name, design="ring", layout=layout, **settings)  # type: ignore[no-any-return]


LANE_LOCKS = ("advisory", "transactionid", "tuple")
"""What a pop waits on for a lane another transaction holds: an advisory lock on the rows layout, the
lane's row on the slots layout."""


def held_then_released(
    dbq: DbQueue, popper: Popper, kinds: tuple[str, ...], release: Callable[[], None]
) -> list[Message]:
    """Once ``popper`` waits for a lock of ``kinds``, keep it waiting past its lock timeout, then call
    ``release``; return what the pop returned."""
    waiting = wait_until_waiting(dbq, popper, kinds)
    if waiting:
        time.sleep(HOLD_PAST_S)
    release()
    got = popper.result()
    assert waiting, f"the pop never waited for the lock: it returned {got!r} at once"
    return got


# -- a lock held past the pop's lock timeout -------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_pop_waits_out_lanes_a_callers_transaction_holds_past_the_lock_timeout(
    dbq: DbQueue, client: Any, layout: str
) -> None:
    """A caller's transaction pops exactly once and keeps every lane with messages locked for longer
    than a pop's 1 s lock timeout; a pop that does not wait, started meanwhile, returns the messages
    the transaction left once it commits (it neither raises ``LockTimeoutError`` nor returns ``[]``)."""
    sent = [f"m{i}" for i in range(20)]
    q = ring(client, "held", layout)
    # The slots layout deals numbers to its 8 lanes: a pop of 8 in the transaction takes one from each
    # and holds them all. The rows layout puts a push in one lane: a pop of 3 holds it.
    ids = q.push_batch(sent)
    taken = 8 if layout == "slots" else 3
    mine = dbq.queue("held")
    with callers_connection(dbq) as conn:
        first = mine.pop(taken, semantics="exactly-once", conn=conn)
        assert [m.id for m in first] == ids[:taken]
        popper = Popper(q, 5)
        got = held_then_released(dbq, popper, LANE_LOCKS, conn.commit)
    # Five of those left (on the slots layout, from the lanes the pop took: not the five lowest ids).
    assert len(got) == 5 and {m.id for m in got} <= set(ids[taken:]), [m.id for m in got]
    rest = q.pop(100)
    out = [*first, *got, *rest]
    assert sorted(m.id for m in out) == ids
    assert checksum(m.payload for m in out) == checksum(sent)


@pytest.mark.parametrize("layout", [*LAYOUTS, "table"])
def test_a_pop_waits_out_a_maintenance_lock_on_the_queues_tables(
    dbq: DbQueue, client: Any, layout: str
) -> None:
    """A session holds the queue's tables locked ACCESS EXCLUSIVE (what a ring rotation's or a
    partition's TRUNCATE and ``compact_rings``' VACUUM FULL take) for longer than a pop's 1 s lock
    timeout; a pop that does not wait returns the messages once the lock is gone. (The table design's
    pops set no lock timeout of their own: they have always waited.)"""
    sent = [{"n": i} for i in range(30)]
    q = client.create_queue("maint", design="table") if layout == "table" else ring(client, "maint", layout)
    q.reclaim_every = 3600.0  # the pop below reclaims no lease first: it waits in its take
    q.pop(1)
    ids = q.push_batch(sent)
    qid = q.settings.queue_id
    if layout == "table":
        pattern = "meta%"
    elif layout == "slots":
        pattern = "ring\\_slots"
    else:
        pattern = f"ring\\_{qid}\\_r%"
    with psycopg.connect(dbq.db.dsn) as holder:
        tables = [
            r[0]
            for r in holder.execute(
                "SELECT format('%%I.%%I', schemaname, tablename) FROM pg_tables "
                "WHERE schemaname = %s AND tablename LIKE %s",
                [dbq.schema, pattern],
            )
        ]
        assert tables
        holder.execute(f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE")
        popper = Popper(q, 10)
        got = held_then_released(dbq, popper, ("relation",), holder.commit)
    assert [m.id for m in got] == ids[:10]
    out = [*got, *q.pop(100)]
    assert [m.id for m in out] == ids
    assert checksum(m.payload for m in out) == checksum(sent)


# -- lanes other pops hold -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_pop_waits_for_a_held_lane_with_messages_when_the_free_lanes_are_empty(
    dbq: DbQueue, client: Any, layout: str
) -> None:
    """Two lanes: one empty and free, the other holding a message behind a caller's transaction that
    popped from it. A pop that does not wait waits for the held lane and returns that message once the
    transaction commits, instead of returning ``[]`` because the lane it could lock was empty."""
    q = ring(client, "two", layout, capacity=16, lanes=2)
    mine = dbq.queue("two")
    if layout == "slots":
        ids = q.push_batch(["a", "b", "c"])  # numbers 1, 2, 3: lane 1 holds 1 and 3, lane 0 holds 2
        sent = ["a", "b", "c"]
    else:
        ids = [*q.push_batch(["a", "c"]), *q.push_batch(["b"])]  # row 0 (lane 0): a, c; row 1 (lane 1): b
        sent = ["a", "c", "b"]
    with callers_connection(dbq) as conn:
        [first] = mine.pop(1, semantics="exactly-once", conn=conn)  # "a": its lane stays held
        [second] = q.pop(1)  # "b", from the other lane, which is empty now
        assert (first.payload, second.payload) == ("a", "b")
        popper = Popper(q, 5)
        got = held_then_released(dbq, popper, LANE_LOCKS, conn.commit)
    assert [m.payload for m in got] == ["c"]
    assert q.pop(5) == []
    out = [first, second, *got]
    assert sorted(m.id for m in out) == sorted(ids)
    assert checksum(m.payload for m in out) == checksum(sent)


def test_a_pop_that_waited_for_a_lane_takes_the_lanes_freed_meanwhile(dbq: DbQueue, client: Any) -> None:
    """Two caller's transactions hold both lanes of a ring of the rows layout: the first took the only
    message of its lane, the second one message of two from the other. A pop waits for the first one's
    lane (the lowest); the second commits, then the first: the lane the pop waited for is empty, and it
    returns the message left in the other one rather than ``[]``. (On the slots layout a pop that found
    nothing calls ring_pop, which takes from the lanes again: test_a_pop_waits_out_lanes_... covers
    its wait.)"""
    q = ring(client, "freed", "rows", capacity=16, lanes=2)
    mine = dbq.queue("freed")
    ids = [*q.push_batch(["a"]), *q.push_batch(["b", "c"])]  # row 0 (lane 0): a; row 1 (lane 1): b, c
    with callers_connection(dbq) as first_conn, callers_connection(dbq) as second_conn:
        [a] = mine.pop(1, semantics="exactly-once", conn=first_conn)
        [b] = mine.pop(1, semantics="exactly-once", conn=second_conn)
        assert (a.payload, b.payload) == ("a", "b")
        popper = Popper(q, 5)

        def release() -> None:
            second_conn.commit()
            time.sleep(0.2)
            first_conn.commit()

        got = held_then_released(dbq, popper, LANE_LOCKS, release)
    assert [m.payload for m in got] == ["c"]
    assert q.pop(5) == []
    out = [a, b, *got]
    assert sorted(m.id for m in out) == sorted(ids)
    assert checksum(m.payload for m in out) == checksum(["a", "b", "c"])
