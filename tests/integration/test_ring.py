"""The ring design's own behaviour: a full ring pushing back, gaps, late pushes, dead holders, no growth.

The conformance suite covers what the ring shares with the table design; these tests cover the
boundary conditions of a ring buffer in a table. Every test counts and checksums what went in and came out.

Each test runs on PostgreSQL, and on SQL Server when ``$DBQUEUE_TEST_MSSQL_DSN`` names one (skipped
otherwise). The helpers that look at slots or hold a number speak each dialect; the tests that measure
PostgreSQL's own storage (sequences in pg_class, HOT updates) skip themselves on SQL Server, saying so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import (
    ConfigurationError,
    DbQueue,
    GroupNotFoundError,
    LeaseExpiredError,
    LockTimeoutError,
    QueueFullError,
    QueueNotFoundError,
)
from tests.dialects import dialect_dbq, postgres_only, run_sql  # noqa: F401 - dialect_dbq is the fixture "dbq"
from tests.helpers import child_processes, horizon_watch, peek_then_pop
from tests.integration.test_conformance import drain

if TYPE_CHECKING:
    from collections.abc import Iterator

    from airflow_dbqueue.engine import Message, Queue
    from airflow_dbqueue.engine.ring import RingQueue

pytestmark = pytest.mark.integration


def ring(dbq: DbQueue, name: str, capacity: int, **settings: Any) -> RingQueue:
    """A ring of the slots layout, which this file is about (the rows layout's are test_ring_rows.py's)."""
    q = dbq.create_queue(name, design="ring", capacity=capacity, layout="slots", **settings)
    return q  # type: ignore[return-value]


def slot_rows(dbq: DbQueue, q: Queue) -> list[tuple[int, int, bool]]:
    """(slot, seq, whether it holds a payload) of every slot of a ring."""
    rows = run_sql(
        dbq,
        "SELECT slot, seq, CASE WHEN payload IS NULL THEN 0 ELSE 1 END FROM {schema}.ring_slots "
        "WHERE queue_id = %(q)s ORDER BY slot",
        {"q": q.settings.queue_id},
    )
    return [(int(a), int(b), bool(c)) for a, b, c in rows]


@contextlib.contextmanager
def holder_connection(dbq: DbQueue) -> Iterator[Any]:
    """A connection of the dialect's driver, not pooled and without autocommit: its transaction, once
    open, lasts until ``rollback()`` or the end of the block."""
    if dbq.dialect == "mssql":
        from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase

        assert isinstance(dbq.db, MssqlDatabase)
        conn = dbq.db.connect()
        try:
            yield conn
        finally:
            conn.close()
        return
    with psycopg.connect(dbq.db.dsn) as conn:
        yield conn


def stall_a_push(holder: Any, dbq: DbQueue, q: RingQueue) -> int:
    """Push one message through the engine in ``holder``'s transaction and stop the push after it took
    its number, before it wrote it; return that number. ``holder``'s transaction stays open.

    Another session holds every slot of the ring locked while the push runs. On PostgreSQL the push's
    write waits for its slot past the lock_timeout of ``holder``'s transaction, and fails in the savepoint
    the engine runs it in; on SQL Server the write reads past the slot until the push_timeout, and the
    push fails. Either way nothing is written, and ``holder``'s transaction keeps what the push took before
    its number (its xid on PostgreSQL, a push lane on SQL Server) until it ends: the number is issued and
    unwritten, its slot is free and unlocked, and its holder is alive, as when a pusher stops between
    taking its numbers and writing them. (A push that wrote its slot in a transaction still open is
    another state: its slot is locked, and gap skips pass over locked slots whatever the holders.)
    """
    before = q.stats().extra["push_position"]
    with dbq.transaction() as blocker:
        if dbq.dialect == "mssql":
            run_sql(
                dbq,
                "SELECT slot FROM {schema}.ring_slots WITH (UPDLOCK, ROWLOCK) WHERE queue_id = %(q)s",
                {"q": q.settings.queue_id},
                blocker,
            )
            timeout, q.push_timeout = q.push_timeout, 0.2
            try:
                with pytest.raises(QueueFullError):
                    q.push_batch(["stalled"], conn=holder)
            finally:
                q.push_timeout = timeout
        else:
            run_sql(
                dbq,
                "SELECT slot FROM {schema}.ring_slots WHERE queue_id = %(q)s FOR SHARE",
                {"q": q.settings.queue_id},
                blocker,
            )
            holder.execute("SET LOCAL lock_timeout = '200ms'")  # opens holder's transaction
            with pytest.raises(LockTimeoutError):
                q.push_batch(["stalled"], conn=holder)
    number = int(q.stats().extra["push_position"])
    assert number == before + 1, "the stalled push took one number"
    return number


# -- settings --------------------------------------------------------------------------------------


def test_ring_settings_are_checked(dbq: DbQueue) -> None:
    q = ring(dbq, "r", 10)
    assert (q.settings.capacity, q.settings.archive, q.settings.max_payload_bytes) == (10, False, 512)
    assert dbq.create_queue("r", design="ring", capacity=10).settings == q.settings
    assert len(slot_rows(dbq, q)) == 10
    with pytest.raises(ConfigurationError, match="do not archive"):
        dbq.create_queue("r2", design="ring", archive=True)
    with pytest.raises(ConfigurationError, match="up to 4000 bytes"):
        dbq.create_queue("r2", design="ring", max_payload_bytes=5000)
    with pytest.raises(ConfigurationError, match="capacity must be in"):
        dbq.create_queue("r2", design="ring", capacity=0)
    with pytest.raises(ConfigurationError, match="ring queues only"):
        dbq.create_queue("t2", capacity=5)
    with pytest.raises(ConfigurationError, match="at most the capacity"):
        q.push_batch(list(range(11)))
    assert [s.name for s in dbq.list_queues()] == ["r"]


def test_drop_ring_removes_its_slots_and_sequences(dbq: DbQueue) -> None:
    postgres_only(dbq, "the test reads pg_class with psycopg")
    q = ring(dbq, "gone", 16)
    q.push_batch([1, 2, 3])
    assert dbq.drop_queue("gone")
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        seqs = c.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind = 'S' AND c.relname LIKE 'ring%%'",
            [dbq.schema],
        ).fetchone()
        rows = c.execute(
            sql.SQL("SELECT (SELECT count(*) FROM {s}.ring_slots), (SELECT count(*) FROM {s}.rings)").format(
                s=sql.Identifier(dbq.schema)
            )
        ).fetchone()
    row = (seqs[0] if seqs else None, *(rows or ()))
    assert row == (0, 0, 0)


# -- a full ring -----------------------------------------------------------------------------------


def test_full_ring_pushes_back_then_raises_a_clear_error(dbq: DbQueue) -> None:
    q = ring(dbq, "full", 4)
    q.push_timeout = 0.3
    assert q.push_batch(["a", "b", "c", "d"]) == [1, 2, 3, 4]
    t0 = time.monotonic()
    with pytest.raises(QueueFullError, match=r"'full'.*capacity 4.*0.3s; nothing of the batch was pushed"):
        q.push_batch(["e", "f"])
    assert time.monotonic() - t0 >= 0.3
    assert q.stats().ready == 4
    # a pusher that waits is let through by a pop; the failed push took no numbers (it found the ring
    # full before taking any), so it left no gap
    q.push_timeout = 30.0
    got: list[list[int]] = []
    pusher = threading.Thread(target=lambda: got.append(q.push_batch(["e", "f"])))
    pusher.start()
    time.sleep(0.3)
    assert pusher.is_alive(), "the push should wait for a full ring"
    assert [m.payload for m in q.pop(4)] == ["a", "b", "c", "d"]
    pusher.join(timeout=30)
    assert not pusher.is_alive()
    assert [m.payload for m in drain(q)] == ["e", "f"]
    st = q.stats()
    assert (st.ready, st.extra["gaps_skipped"], st.extra["ring_used"]) == (0, 0, 0), st
    assert [m.id for m in drain(q)] == []
    assert got == [[5, 6]]


def test_a_push_in_a_callers_transaction_waits_for_a_full_ring_and_commits_with_it(dbq: DbQueue) -> None:
    """A batch that finds the ring full inside the caller's transaction waits (between calls, each in a
    savepoint) until a pop frees its slots; the caller's transaction stays usable and its commit
    delivers the batch, whole and in order."""
    q = ring(dbq, "fullconn", 4)
    q.push_timeout = 30.0
    assert q.push_batch(["a", "b", "c", "d"]) == [1, 2, 3, 4]
    got: list[list[int]] = []
    errors: list[BaseException] = []

    def push_in_transaction() -> None:
        try:
            with dbq.transaction() as conn:
                got.append(q.push_batch(["e", "f"], conn=conn))
                got.append(q.push_batch(["g"], conn=conn))  # the transaction goes on after the wait
        except BaseException as exc:
            errors.append(exc)

    pusher = threading.Thread(target=push_in_transaction)
    pusher.start()
    time.sleep(0.3)
    assert pusher.is_alive(), "the push should wait for a full ring"
    assert [m.payload for m in q.pop(3)] == ["a", "b", "c"]
    pusher.join(timeout=30)
    assert not pusher.is_alive() and not errors, errors
    assert got == [[5, 6], [7]]
    assert [(m.id, m.payload) for m in drain(q)] == [(4, "d"), (5, "e"), (6, "f"), (7, "g")]
    st = q.stats()
    assert (st.ready, st.extra["gaps_skipped"], st.extra["ring_used"]) == (0, 0, 0), st


def test_a_push_of_one_into_a_full_ring_waits_with_its_number(dbq: DbQueue) -> None:
    """A push of one outside a transaction takes its number in one statement (ring_push_one); when the
    slot is not free it writes that number waiting (ring_push), so the full ring leaves no gap."""
    q = ring(dbq, "full1", 4)
    assert [q.push(p) for p in ("a", "b", "c", "d")] == [1, 2, 3, 4]
    got: list[int] = []
    pusher = threading.Thread(target=lambda: got.append(q.push("e")))
    pusher.start()
    time.sleep(0.3)
    assert pusher.is_alive(), "the push should wait for a full ring"
    assert [m.payload for m in q.pop(1)] == ["a"]
    pusher.join(timeout=30)
    assert not pusher.is_alive()
    assert got == [5]
    assert [(m.id, m.payload) for m in drain(q)] == [(2, "b"), (3, "c"), (4, "d"), (5, "e")]
    st = q.stats()
    assert (st.ready, st.extra["gaps_skipped"], st.extra["push_position"], st.extra["ring_used"]) == (
        0,
        0,
        5,
        0,
    )


def test_pushes_of_one_never_take_a_number_of_a_batch(dbq: DbQueue) -> None:
    """Four threads pushing one at a time (ring_push_one) beside one pushing batches of 16 (ring_push)
    into a ring of 64 that wraps: every message is delivered once, each batch with contiguous ids.
    (The window this guards, between a batch's first number and its range, is too short for threads to
    hit reliably: the next test holds the push lock itself.)"""
    q = ring(dbq, "mixed", 64)
    q.push_timeout = 5.0
    singles, batches, size = 4, 40, 16
    per_single = 150
    total = singles * per_single + batches * size
    errors: list[BaseException] = []
    batch_ids: list[list[int]] = []
    single_ids: list[int] = []

    def push_singles(k: int) -> None:
        try:
            for i in range(per_single):
                single_ids.append(q.push(f"s{k}-{i}"))
        except BaseException as exc:
            errors.append(exc)

    def push_batches() -> None:
        try:
            for b in range(batches):
                batch_ids.append(q.push_batch([f"b{b}-{i}" for i in range(size)]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=push_singles, args=(k,)) for k in range(singles)]
    threads.append(threading.Thread(target=push_batches))
    for t in threads:
        t.start()
    got: list[Message] = []
    deadline = time.monotonic() + 120
    while len(got) < total and time.monotonic() < deadline and not errors:
        batch = q.pop(32, wait=0.2, poll_interval=0.05)
        # in id order within a pop (across pops, a lower number may commit later)
        assert [m.id for m in batch] == sorted(m.id for m in batch)
        got += batch
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert all(ids == list(range(ids[0], ids[0] + size)) for ids in batch_ids), batch_ids
    pushed_ids = single_ids + [i for ids in batch_ids for i in ids]
    assert len(pushed_ids) == len(set(pushed_ids)) == total
    sent = [f"s{k}-{i}" for k in range(singles) for i in range(per_single)]
    sent += [f"b{b}-{i}" for b in range(batches) for i in range(size)]
    assert sorted(m.id for m in got) == sorted(pushed_ids)
    assert _checksum(sorted(m.payload for m in got)) == _checksum(sorted(sent))
    st = q.stats()
    assert st.extra["push_position"] == total + st.extra["gaps_skipped"], st
    assert q.pop(10) == []


def test_a_push_of_one_waits_while_a_batch_takes_its_range(dbq: DbQueue) -> None:
    """A batch takes its range (nextval, then setval to its last number) under the ring's push lock;
    a push of one takes its number under the same lock, shared, so it never lands inside a range being
    taken. Here a session holds the lock as a batch does in that instant: the push of one waits for it,
    then takes the next number."""
    postgres_only(dbq, "the push lock is a PostgreSQL advisory lock (SQL Server pushes of one run ring_push)")
    q = ring(dbq, "pushlock", 8)
    assert q.push("a") == 1
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        seq = f"{dbq.schema}.ring_{q.settings.queue_id}_seq"
        key = c.execute("SELECT (%s::regclass::oid::bigint - 2147483648)::integer", [seq]).fetchone()
        assert key is not None
        c.execute("SELECT pg_advisory_lock(1685221713, %s)", [key[0]])
        got: list[int] = []
        pusher = threading.Thread(target=lambda: got.append(q.push("b")))
        pusher.start()
        time.sleep(0.5)
        assert pusher.is_alive(), "a push of one must wait for the push lock"
        assert got == [] and q.stats().extra["push_position"] == 1
        c.execute("SELECT setval(%s::regclass, 5)", [seq])  # as a batch of 4 would: numbers 2..5
        c.execute("SELECT pg_advisory_unlock(1685221713, %s)", [key[0]])
        pusher.join(timeout=30)
    assert got == [6]
    st = q.stats()
    assert st.extra["push_position"] == 6, st
    assert q.recover_gaps(wait=5.0) == 4  # 2..5, taken and never written
    assert [(m.id, m.payload) for m in drain(q)] == [(1, "a"), (6, "b")]


# -- gaps ------------------------------------------------------------------------------------------


class _Rollback(Exception):
    pass


def test_rolled_back_pushes_leave_gaps_that_pops_skip(dbq: DbQueue) -> None:
    q = ring(dbq, "gaps", 8)
    for _ in range(3):  # three rolled-back pushes of 2 messages: numbers taken, nothing written
        with pytest.raises(_Rollback), dbq.transaction() as conn:
            q.push_batch(["lost", "lost"], conn=conn)
            raise _Rollback
    sent = [f"m{i}" for i in range(20)]
    got: list[Message] = []
    for first in range(0, 20, 4):  # the ring wraps over the gaps twice
        q.push_batch(sent[first : first + 4])
        got += q.pop(4)
    assert [m.payload for m in got] == sent
    assert [m.id for m in got] == list(range(7, 27))
    st = q.stats()
    assert (st.ready, st.extra["gaps_skipped"], st.extra["pop_position"], st.extra["push_position"]) == (
        0,
        6,
        27,
        26,
    )


def test_a_live_holder_is_waited_for_and_a_dead_one_skipped_at_once(dbq: DbQueue) -> None:
    q = ring(dbq, "holder", 8)
    with holder_connection(dbq) as holder:
        assert stall_a_push(holder, dbq, q) == 1  # a push that took number 1 and stalls
        q.push_batch(["two", "three"])
        assert [m.payload for m in q.pop(5)] == ["two", "three"]
        for _ in range(3):
            assert q.pop(5) == []
        st = q.stats()
        assert (st.extra["pop_position"], st.extra["gaps_skipped"]) == (1, 0), "a live holder is waited for"
        holder.rollback()  # the holder is gone: its number is skipped by the next pops, no timeout
        # Two pops give it up (the first lists the transactions running, the second finds them gone),
        # unless another transaction with an xid (an autoanalyze writing its statistics) was running
        # at the first: then a later pop. Long before the gap timeout, which is set out of reach.
        q.gap_timeout = 60.0
        deadline = time.monotonic() + 10.0
        while True:
            assert q.pop(5) == []
            st = q.stats()
            if st.extra["gaps_skipped"] or time.monotonic() >= deadline:
                break
        assert (st.extra["pop_position"], st.extra["gaps_skipped"]) == (4, 1), st


def test_a_stuck_live_holder_is_skipped_after_the_gap_timeout(dbq: DbQueue) -> None:
    q = ring(dbq, "stuck", 8)
    q.gap_timeout = 0.3
    with holder_connection(dbq) as holder:
        assert stall_a_push(holder, dbq, q) == 1
        q.push_batch(["two"])
        assert [m.payload for m in q.pop(5)] == ["two"]  # messages past the gap are not held back
        assert q.stats().extra["gaps_skipped"] == 0
        time.sleep(0.4)
        assert q.pop(1) == []
        assert q.pop(1) == []
        st = q.stats()
        assert (st.extra["gaps_skipped"], st.extra["pop_position"]) == (1, 3), st


def test_after_the_gap_timeout_a_whole_abandoned_run_is_skipped_at_once(dbq: DbQueue) -> None:
    """A rolled-back batch leaves a run of numbers at the head while a live holder blocks the proof.

    The live holder stands for pushers that wait on a full ring: they are in progress, so no snapshot
    proves the run abandoned. Giving up one number per gap timeout stalled a 10M soak for 30 s (the
    waiting pushers timed out, leaving new gaps). After the timeout the whole unwritten run at the head
    goes at once; the live holder's number, past a written one, is left alone.
    """
    q = ring(dbq, "run", 8)
    q.gap_timeout = 0.3
    with pytest.raises(_Rollback), dbq.transaction() as conn:  # numbers 1 .. 5 taken, nothing written
        q.push_batch(["lost"] * 5, conn=conn)
        raise _Rollback
    q.push_batch(["six"])
    with holder_connection(dbq) as holder:
        assert stall_a_push(holder, dbq, q) == 7  # alive, never written while the test runs
        assert [m.payload for m in q.pop(5)] == ["six"]
        assert q.stats().extra["gaps_skipped"] == 0, "a live transaction blocks the proof"
        time.sleep(0.4)
        assert q.pop(1) == []
        st = q.stats()
        assert (st.extra["gaps_skipped"], st.extra["pop_position"]) == (5, 7), st
        q.push_batch(["eight"])
        assert [(m.id, m.payload) for m in q.pop(5)] == [(8, "eight")]
        st = q.stats()
        assert (st.extra["gaps_skipped"], st.extra["pop_position"]) == (5, 7), "7 is alive: kept"
        holder.rollback()
    for _ in range(3):
        assert q.pop(5) == []
    st = q.stats()
    assert (st.extra["gaps_skipped"], st.extra["pop_position"]) == (6, 9), st


def test_the_gap_timeout_skips_nothing_behind_a_head_written_by_a_live_transaction(dbq: DbQueue) -> None:
    """A push inside a caller's open transaction has written the head: it is a live push, not a gap.

    The run that a gap timeout gives up stops at the first locked number, so nothing behind it goes
    (pushes behind such a head may be waiting on the ring, and their numbers are theirs).
    """
    q = ring(dbq, "livehead", 8)
    q.gap_timeout = 0.3
    with dbq.transaction() as writer:
        assert q.push_batch(["one"], conn=writer) == [1]
        with pytest.raises(_Rollback), dbq.transaction() as conn:  # numbers 2 and 3: abandoned
            q.push_batch(["lost", "lost"], conn=conn)
            raise _Rollback
        assert q.push_batch(["four"]) == [4]
        assert [m.payload for m in q.pop(5)] == ["four"]
        time.sleep(0.4)
        for _ in range(2):
            assert q.pop(5) == []
        st = q.stats()
        assert (st.extra["gaps_skipped"], st.extra["pop_position"]) == (0, 1), st
    assert [(m.id, m.payload) for m in drain(q)] == [(1, "one")]
    for _ in range(3):
        q.pop(5)
    st = q.stats()
    assert (st.ready, st.extra["gaps_skipped"], st.extra["pop_position"]) == (0, 2, 5), st


def test_a_pop_lists_holders_only_for_a_gap_that_stays(dbq: DbQueue, monkeypatch: pytest.MonkeyPatch) -> None:
    """pg_locks is read only when the same unwritten head is seen twice, never for a caught-up ring:
    the engine's own pops, with the gap each ring_pop was given and the (gap, issued position,
    holders) it reported recorded on the way."""
    postgres_only(dbq, "the holders come from PostgreSQL's pg_locks")
    q = ring(dbq, "holders", 8)
    q.push_batch(["a", "b"])
    calls: list[tuple[Any, ...]] = []
    fetchall = dbq.db.fetchall

    def spy(name: str, params: Any = None, conn: Any = None, **kw: Any) -> Any:
        rows = fetchall(name, params, conn, **kw)
        if name == "ring_pop":
            meta = rows[-1]
            calls.append((params["gap"], meta[6], meta[7], meta[8] is not None))
        return rows

    monkeypatch.setattr(dbq.db, "fetchall", spy)
    got = [(m.id, m.payload) for m in q.pop(10)]
    assert got == [(1, "a"), (2, "b")], "each pushed message came back once, with its payload"
    assert q.pop(10) == []
    assert calls and set(calls) == {(None, None, 2, False)}, "caught up: no gap, no list"
    with holder_connection(dbq) as holder:
        assert stall_a_push(holder, dbq, q) == 3  # alive and unwritten
        calls.clear()
        assert q.pop(10) == []
        # First sighting: no list. Passed back: the holders are listed; they stay, so the pop ends.
        assert calls == [(None, 3, 3, False), (3, 3, 3, True), (3, 3, 3, True)], calls
        calls.clear()
        assert q.pop(10) == []
        assert calls == [(3, 3, 3, True)], "seen again: listed again, nothing given up"
        holder.rollback()
    calls.clear()
    assert q.pop(10) == []
    assert calls == [(3, None, 3, False)], "the holder gone: 3 given up at once, and no gap left"
    assert q.stats().extra["gaps_skipped"] == 1
    q.push_batch(["c"])
    assert [(m.id, m.payload) for m in q.pop(10)] == [(4, "c")], "nothing more was taken"


def test_a_late_push_of_a_skipped_number_is_pushed_again_whole(dbq: DbQueue) -> None:
    q = ring(dbq, "late", 8)
    q.push_batch(["a", "b"])
    # Consumers gave numbers 3 and 4 up while their (slow) holder had not written them yet: the slots
    # already hold them without a payload. The push that takes 3 and 4 finds that, fails whole, and
    # takes 5 and 6.
    run_sql(
        dbq,
        "UPDATE {schema}.ring_slots SET seq = seq + 8, payload = NULL "
        "WHERE queue_id = %(q)s AND slot IN (3, 4)",
        {"q": q.settings.queue_id},
    )
    assert q.push_batch(["c", "d"]) == [5, 6]
    assert [(m.id, m.payload) for m in drain(q)] == [(1, "a"), (2, "b"), (5, "c"), (6, "d")]


def test_a_push_of_one_whose_number_the_ring_went_round_over_pushes_again(
    dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push of one that finds its slot not free (ring_push_one) writes its number in a second
    statement (ring_push), and in between no transaction holds the number: a gap's proof can give it up
    then, and the ring go round over it before ring_push looks at its slot (the test_ring pushes of one
    beside a batch pusher hit it). ring_push must see its number given up all the same (DQ002) and the
    push take a new number, rather than wait for a slot that will never hold the number before its own
    again and fail as full after push_timeout. Here the hand-off is stopped at that instant: the
    numbers 1..4 popped by a pop that gives the push's number 5 up (no transaction holds it), 6..9
    pushed over it (9 in 5's slot) and popped, then the push goes on."""
    q = ring(dbq, "wentround", 4)
    q.push_timeout = 3.0
    assert q.push_batch(["a", "b", "c", "d"]) == [1, 2, 3, 4]
    got: list[Message] = []
    handed: list[int] = []
    fetchone = dbq.db.fetchone

    def between(name: str, params: Any = None, conn: Any = None, **kw: Any) -> Any:
        if name == "ring_push" and params.get("first") is not None and not handed:
            handed.append(params["first"])
            got.extend(q.pop(10))  # 1..4; then 5 seen twice, its holders listed (none) and given up
            if q.stats().extra["gaps_skipped"] == 0:  # a proof that needs another look (SQL Server's lanes)
                q.recover_gaps(wait=5.0)
            assert q.stats().extra["gaps_skipped"] == 1
            assert q.push_batch(["e", "f", "g", "h"]) == [6, 7, 8, 9]
            got.extend(q.pop(10))
        return fetchone(name, params, conn, **kw)

    monkeypatch.setattr(dbq.db, "fetchone", between)
    t0 = time.monotonic()
    pushed = q.push("x")
    assert time.monotonic() - t0 < q.push_timeout, "the push waited for a slot that had gone round"
    assert handed == [5] and pushed == 10
    got += drain(q)
    assert [m.id for m in got] == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert [m.payload for m in got] == ["a", "b", "c", "d", "e", "f", "g", "h", "x"]
    st = q.stats()
    assert (st.ready, st.extra["gaps_skipped"], st.extra["push_position"], st.extra["ring_used"]) == (
        0,
        1,
        10,
        0,
    ), st


# -- dead holders ----------------------------------------------------------------------------------


def _push_and_hang(*, dsn: str, schema: str, queue: str, payloads: list[str], report: Any) -> None:
    """Push a batch inside a transaction that never commits, report, and wait to be killed."""
    try:
        with DbQueue(dsn, schema=schema, pool_size=1) as dbq:
            q = dbq.queue(queue)
            with dbq.transaction() as conn:
                ids = q.push_batch(payloads, conn=conn)
                report.put(("pushed", ids))
                time.sleep(300)
    except BaseException:
        report.put(("error", traceback.format_exc()))


def _lease_and_hang(*, dsn: str, schema: str, queue: str, n: int, report: Any) -> None:
    try:
        with DbQueue(dsn, schema=schema, pool_size=1) as dbq:
            msgs = dbq.queue(queue).pop(n, semantics="at-least-once", visibility_timeout=1.0)
            report.put(("held", [m.receipt for m in msgs]))
            time.sleep(300)
    except BaseException:
        report.put(("error", traceback.format_exc()))


def _run_and_kill(target: Any, **kwargs: Any) -> Any:
    ctx = child_processes()
    report = ctx.Queue()
    child = ctx.Process(target=target, kwargs={**kwargs, "report": report})
    child.start()
    try:
        kind, value = report.get(timeout=120)
        assert kind != "error", value
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(timeout=30)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
        report.close()
    return value


@pytest.mark.slow
def test_producer_sigkilled_between_taking_numbers_and_committing(dbq: DbQueue) -> None:
    q = ring(dbq, "killed", 16)
    q.push_batch(["before"])
    dead_ids = _run_and_kill(
        _push_and_hang, dsn=dbq.db.dsn, schema=dbq.schema, queue="killed", payloads=["dead"] * 5
    )
    assert dead_ids == [2, 3, 4, 5, 6]
    # The ring keeps flowing: 10 laps of it, pushed and popped in step, over the dead push's numbers.
    sent = [f"m{i}" for i in range(160)]
    got = [m.payload for m in q.pop(10)]
    for first in range(0, 160, 8):
        q.push_batch(sent[first : first + 8])
        got += [m.payload for m in q.pop(8)]
    got += [m.payload for m in drain(q)]
    assert got == ["before", *sent]
    st = q.stats()
    assert (st.ready, st.in_flight, st.extra["gaps_skipped"]) == (0, 0, 5), st
    # every number pushed is below the floor: no slot stays taken
    assert st.extra["floor"] > st.extra["push_position"] and st.extra["ring_used"] == 0, st


@pytest.mark.slow
def test_consumer_sigkilled_holding_leases_frees_its_slots_on_expiry(dbq: DbQueue) -> None:
    q = ring(dbq, "leases", 10, max_attempts=3)
    q.push_timeout = 20.0
    sent = [f"m{i}" for i in range(10)]
    ids = q.push_batch(sent)
    held = _run_and_kill(_lease_and_hang, dsn=dbq.db.dsn, schema=dbq.schema, queue="leases", n=4)
    assert held == [(i, 1) for i in ids[:4]]
    rest = q.pop(10, semantics="at-least-once")
    assert [m.id for m in rest] == ids[4:]
    q.ack(rest)
    # The dead consumer's 4 slots stay taken until its leases expire: a push of 10 waits for them.
    more = [f"n{i}" for i in range(10)]
    t0 = time.monotonic()
    pusher_ids: list[list[int]] = []
    pusher = threading.Thread(target=lambda: pusher_ids.append(q.push_batch(more)))
    pusher.start()
    again: list[Message] = []
    deadline = time.monotonic() + 30
    while len(again) < 14 and time.monotonic() < deadline:
        got = q.pop(20, semantics="at-least-once", wait=1.0, poll_interval=0.1)
        q.ack(got)
        again += got
    pusher.join(timeout=30)
    assert time.monotonic() - t0 >= 0.5, "the leases held the ring for about their 1 s"
    assert [m.id for m in again[:4]] == ids[:4] and all(m.attempts == 2 for m in again[:4])
    assert [m.payload for m in again] == sent[:4] + more
    assert [m.id for m in again[4:]] == pusher_ids[0] == list(range(11, 21))
    with pytest.raises(LeaseExpiredError):  # the dead consumer's receipts are stale
        q.ack_receipts(held)
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed, st.extra["ring_used"]) == (0, 0, 0, 0), st


# -- maintenance -----------------------------------------------------------------------------------


def _checksum(payloads: list[Any]) -> str:
    return hashlib.sha256(json.dumps(payloads).encode()).hexdigest()


@pytest.mark.slow
def test_maintenance_alone_skips_the_gaps_of_rolled_back_and_killed_pushers(dbq: DbQueue) -> None:
    """A ring nobody pops: maintenance gives up the numbers of rolled-back pushes and of a SIGKILLed
    producer, at the head and past it, and what was pushed around them is delivered whole, in order."""
    q = ring(dbq, "unpopped", 16)
    with pytest.raises(_Rollback), dbq.transaction() as conn:  # numbers 1..3, at the head
        q.push_batch(["lost"] * 3, conn=conn)
        raise _Rollback
    dead = _run_and_kill(
        _push_and_hang, dsn=dbq.db.dsn, schema=dbq.schema, queue="unpopped", payloads=["x"] * 2
    )
    assert dead == [4, 5]
    sent = [f"m{i}" for i in range(6)]
    assert q.push_batch(sent[:3]) == [6, 7, 8]
    with pytest.raises(_Rollback), dbq.transaction() as conn:  # numbers 9 and 10, past the head
        q.push_batch(["lost"] * 2, conn=conn)
        raise _Rollback
    assert q.push_batch(sent[3:]) == [11, 12, 13]
    st = q.stats()
    assert (st.ready, st.extra["pop_position"], st.extra["gaps_skipped"]) == (6, 1, 0), st

    assert dbq.maintenance().recover(["unpopped"]) == {
        "unpopped": {"reclaimed": 0, "gaps_skipped": 7, "batches_purged": 0}
    }
    st = q.stats()
    assert (st.ready, st.extra["pop_position"], st.extra["gaps_skipped"], st.extra["push_position"]) == (
        6,
        6,
        7,
        13,
    ), st
    slots = {slot: (seq, written) for slot, seq, written in slot_rows(dbq, q)}
    assert [slots[n % 16] for n in (1, 2, 3, 4, 5, 9, 10)] == [(n, False) for n in (1, 2, 3, 4, 5, 9, 10)]
    assert dbq.maintenance().recover(["unpopped"]) == {
        "unpopped": {"reclaimed": 0, "gaps_skipped": 0, "batches_purged": 0}
    }

    # A consumer that comes later starts at the first message; the ring then laps twice over the
    # skipped numbers' slots. Counts and checksums of everything pushed against everything popped.
    got = drain(dbq.queue("unpopped"))
    assert [m.id for m in got] == [6, 7, 8, 11, 12, 13]
    more = [f"n{i}" for i in range(32)]
    for first in range(0, 32, 8):
        q.push_batch(more[first : first + 8])
        got += drain(q)
    assert len(got) == len(sent) + len(more)
    assert _checksum([m.payload for m in got]) == _checksum(sent + more)
    assert [m.id for m in got][6:] == list(range(14, 46))
    st = q.stats()
    assert (st.ready, st.in_flight, st.extra["gaps_skipped"], st.extra["ring_used"]) == (0, 0, 7, 0), st


def test_maintenance_leaves_the_numbers_of_a_live_push_alone(dbq: DbQueue) -> None:
    q = ring(dbq, "live", 8)
    with holder_connection(dbq) as holder:
        assert stall_a_push(holder, dbq, q) == 1  # a push that took number 1 and stalls
        q.push_batch(["two", "three"])
        t0 = time.monotonic()
        assert q.recover_gaps(wait=0.3) == 0  # the holder may still write number 1
        assert time.monotonic() - t0 >= 0.3
        assert q.maintain() == {"reclaimed": 0, "gaps_skipped": 0, "batches_purged": 0}
        assert (q.stats().extra["pop_position"], q.stats().extra["gaps_skipped"]) == (1, 0)
        holder.rollback()  # gone: its number is given up by maintenance, at once
    assert q.maintain() == {"reclaimed": 0, "gaps_skipped": 1, "batches_purged": 0}
    st = q.stats()
    assert (st.ready, st.extra["pop_position"], st.extra["gaps_skipped"]) == (2, 2, 1), st
    assert [(m.id, m.payload) for m in drain(dbq.queue("live"))] == [(2, "two"), (3, "three")]


def test_maintenance_reclaims_expired_ring_leases(dbq: DbQueue) -> None:
    q = ring(dbq, "leased", 8, visibility_timeout=0.2, max_attempts=2)
    sent = ["a", "b", "c"]
    ids = q.push_batch(sent)
    q.reclaim_every = 3600.0  # only maintenance reclaims here
    held = q.pop(3, semantics="at-least-once")
    assert [m.id for m in held] == ids
    time.sleep(0.3)
    assert dbq.maintenance().recover(["leased"]) == {
        "leased": {"reclaimed": 3, "gaps_skipped": 0, "batches_purged": 0}
    }
    again = q.pop(3, semantics="at-least-once")
    assert [(m.id, m.payload, m.attempts) for m in again] == [
        (i, p, 2) for i, p in zip(ids, sent, strict=True)
    ]
    with pytest.raises(LeaseExpiredError):
        q.ack(held)
    assert q.ack(again) == 3
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed, st.extra["ring_used"]) == (0, 0, 0, 0), st


# -- the table never grows -------------------------------------------------------------------------


@pytest.mark.slow
def test_ring_table_never_grows_and_updates_are_hot(pg_dsn: str, dbq: DbQueue) -> None:
    """32,000 unique messages through 500 slots, at most and at least once: the slots' table and the
    lanes' keep their size, only pushes write slots (pops read them), those writes are HOT, and every
    message comes out once with its payload.

    Their size holds while nothing else holds the xmin horizon: a snapshot held elsewhere, even an
    autovacuum ANALYZE's of another table for a second, keeps the versions the pushes replace, and
    the pushes then write to new pages (the ring's rows layout is the design that stays flat then).
    The run is watched for such holders; a run that saw one is repeated on a new ring (up to three
    times), and growth in a run that saw none fails at once."""
    postgres_only(dbq, "HOT updates and pg_total_relation_size are PostgreSQL's")
    for attempt in range(3):
        grew, holders = _hot_ring_run(pg_dsn, dbq, f"hot{attempt}")
        if not grew:
            return
        assert holders, f"the ring's tables grew ({grew}) while nothing held the xmin horizon"
    pytest.fail(f"the ring's tables grew in three runs, each while the horizon was held: {holders}")


def _hot_ring_run(pg_dsn: str, dbq: DbQueue, name: str) -> tuple[str, list[str]]:
    """One run of the test above on a new ring: '' or how its tables grew, and the horizon holders seen."""
    with DbQueue(pg_dsn, schema=dbq.schema, pool_size=1) as one:
        q = one.create_queue(
            name, design="ring", layout="slots", capacity=500, payload_type="bytes", max_payload_bytes=300
        )
        with one.db.connection() as c:
            own = int(c.execute("SELECT pg_backend_pid()").fetchone()[0])
        sent: list[bytes] = []
        got: list[Message] = []

        def cycle(n: int, semantics: str) -> None:
            for _ in range(n // 100):
                batch = [len(sent).to_bytes(8, "big") + os.urandom(292) for _ in range(100)]
                ids = q.push_batch(batch)
                sent.extend(batch)
                msgs = q.pop(100, semantics=semantics)
                assert [m.id for m in msgs] == ids
                if semantics == "at-least-once":
                    assert q.ack(msgs) == 100
                got.extend(msgs)

        def sizes() -> tuple[int, int]:
            with psycopg.connect(pg_dsn, autocommit=True) as c:
                row = c.execute(
                    "SELECT pg_total_relation_size(format('%%I.ring_slots', %s::text)::regclass), "
                    "pg_total_relation_size(format('%%I.ring_lanes', %s::text)::regclass)",
                    [dbq.schema, dbq.schema],
                ).fetchone()
            assert row is not None
            return int(row[0]), int(row[1])

        def updates() -> tuple[int, int]:
            with one.db.connection() as c:
                c.execute("SELECT pg_stat_force_next_flush()")
            with psycopg.connect(pg_dsn, autocommit=True) as c:
                row = c.execute(
                    "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                    "WHERE schemaname = %s AND relname = 'ring_slots'",
                    [dbq.schema],
                ).fetchone()
            assert row is not None
            return int(row[0]), int(row[1])

        cycle(2000, "at-most-once")
        first, upd0 = sizes(), updates()
        with horizon_watch(pg_dsn, exclude_pids=[own]) as holders:
            cycle(20_000, "at-most-once")
            cycle(10_000, "at-least-once")
        last = sizes()
        upd, hot = (a - b for a, b in zip(updates(), upd0, strict=True))
        assert upd == 30_000, f"{upd} slot updates for 30,000 pushes: pops must not write slots"
        assert len(got) == len(sent) == 32_000
        assert [m.id for m in got] == list(range(1, 32_001))
        assert _checksum([m.payload.hex() for m in got]) == _checksum([p.hex() for p in sent])
        st = q.stats()
        assert (st.ready, st.in_flight, st.extra["ring_used"]) == (0, 0, 0), st
        assert q.pop(10) == []
        if last == first:
            assert hot / upd > 0.95, f"only {hot} of {upd} updates were HOT"
            return "", holders
        one.drop_queue(name)
        return f"{first} to {last} bytes, {hot} of {upd} updates HOT", holders


def test_readiness_tells_an_empty_ring_from_a_dropped_one_in_one_statement(
    dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An observer's look at an empty ring (the trigger's, on every wake) is one statement; the same
    look at a dropped ring or group raises QueueNotFoundError or GroupNotFoundError."""
    q = ring(dbq, "looked", 8)
    g = q.add_group("side")
    sent: list[str] = []
    real = q._db.fetchone
    monkeypatch.setattr(q._db, "fetchone", lambda name, *a, **k: sent.append(name) or real(name, *a, **k))
    assert (q.readiness(), g.readiness()) == ((0, None), (0, None))
    assert sent == ["ring_ready_head", "ring_ready_head"]
    ids = q.push_batch(["a", "b"])
    assert (q.readiness(), g.readiness()) == ((2, (ids[0], 0)), (2, (ids[0], 0)))
    assert [m.payload for m in g.pop(5)] == ["a", "b"]
    assert q.drop_group("side") is True
    with pytest.raises(GroupNotFoundError, match="side"):
        g.readiness()
    assert [m.payload for m in q.pop(5)] == ["a", "b"]
    assert dbq.drop_queue("looked")
    with pytest.raises(QueueNotFoundError, match="'looked'"):
        q.readiness()


def test_a_handle_of_a_dropped_ring_raises_queue_not_found_and_writes_nothing(dbq: DbQueue) -> None:
    """After drop_queue, an earlier handle's push and pop raise QueueNotFoundError at once (no wait for
    a full ring), and a new ring of the same name is untouched by them."""
    old = ring(dbq, "gone2", 8)
    old.push_timeout = 30.0
    assert old.push_batch(["a"]) == [1]
    assert dbq.drop_queue("gone2")
    new = ring(dbq, "gone2", 8)
    t0 = time.monotonic()
    for push in (lambda: old.push("x"), lambda: old.push_batch(["x", "y"])):
        with pytest.raises(QueueNotFoundError, match="'gone2'"):
            push()
    with pytest.raises(QueueNotFoundError, match="'gone2'"):
        old.pop(5)
    assert time.monotonic() - t0 < 10, "a push to a dropped ring waited"
    st = new.stats()
    assert (st.ready, st.extra["push_position"]) == (0, 0), st
    assert new.push_batch(["b"]) == [1]
    assert [(m.id, m.payload) for m in drain(new)] == [(1, "b")]


def test_an_ack_of_a_pop_past_the_end_of_the_slots_deletes_its_two_leases_at_once(dbq: DbQueue) -> None:
    """A batch pop that runs past the end of the ring's slots writes two lease rows; acking its
    messages deletes both in the one statement of a whole ack (no message becomes a retry row), and
    the ack of only part of them is refused by that statement and settled message by message."""
    postgres_only(dbq, "the test counts the ring's rows with PostgreSQL's statistics")
    q = ring(dbq, "wrapack", 8, lanes=2)
    assert q.push_batch(list(range(6))) == list(range(1, 7))
    assert [m.id for m in q.pop(6)] == list(range(1, 7))  # positions now at 7 and 8
    sent = [f"m{i}" for i in range(6)]
    assert q.push_batch(sent) == list(range(7, 13))  # numbers 7..12: slots 7, 0, 1, 2, 3, 4
    got = q.pop(6, semantics="at-least-once")
    assert [(m.id, m.payload) for m in got] == list(zip(range(7, 13), sent, strict=True))
    leases = run_sql(
        dbq, "SELECT count(*) FROM {schema}.ring_leases WHERE queue_id = %(q)s", {"q": q.settings.queue_id}
    )
    assert leases == [(2,)], "the take ran past the end of the slots: two lease rows"
    # the engine's whole-lease ack, as q.ack runs it first: both rows go in one statement
    deleted = dbq.db.fetchall("ring_ack", q._receipt_params(got))
    assert sorted(r[0] for r in deleted) == [1, 5], deleted  # slot 7, then slots 0..4
    with pytest.raises(LeaseExpiredError):  # acked already: the receipts hold nothing now
        q.ack(got)
    rows = run_sql(
        dbq, "SELECT (SELECT count(*) FROM {schema}.ring_leases), (SELECT count(*) FROM {schema}.ring_retry)"
    )
    assert rows == [(0, 0)]
    more = q.push_batch(["a", "b", "c"])
    part = q.pop(3, semantics="at-least-once")
    assert [m.id for m in part] == more
    assert q.ack(part[:1]) == 1  # part of a lease: settled, the rest stay leased
    assert q.ack(part[1:]) == 2
    st = q.stats()
    assert (st.ready, st.in_flight, st.extra["ring_used"]) == (0, 0, 0), st


def test_the_rings_fill_counts_the_numbers_from_its_floor(dbq: DbQueue) -> None:
    """ring_used is the numbers from the floor (the lowest one a consumer may still need) to the push
    position, so ring_fill never passes 1: here against states known by construction."""
    q = ring(dbq, "fill", 500, max_attempts=3)
    assert q.push_batch([{"i": i} for i in range(255)]) == list(range(1, 256))
    st = q.stats()
    assert (st.ready, st.extra["ring_used"], st.extra["ring_fill"], st.extra["floor"]) == (255, 255, 0.51, 1)
    held = q.pop(100, semantics="at-least-once")  # 1..100 leased: the floor stays at 1
    assert [m.id for m in held] == list(range(1, 101))
    done = q.pop(100)  # 101..200 finished
    assert [m.id for m in done] == list(range(101, 201))
    st = q.stats()
    assert (st.ready, st.in_flight, st.extra["ring_used"], st.extra["floor"]) == (55, 100, 255, 1), st
    assert q.ack(held) == 100  # the floor moves past everything finished: 201
    st = q.stats()
    assert (st.ready, st.extra["ring_used"], st.extra["ring_fill"], st.extra["floor"]) == (55, 55, 0.11, 201)
    assert q.push_batch([{"i": i} for i in range(445)]) == list(range(256, 701))  # full: 500 numbers
    st = q.stats()
    assert (st.ready, st.extra["ring_used"], st.extra["ring_fill"]) == (500, 500, 1.0), st
    assert len(drain(q)) == 500
    with pytest.raises(ConfigurationError, match="nack delay"):
        q.nack(held, delay=float("nan"))


def test_pops_of_one_pass_a_lane_whose_push_is_in_progress_and_hold_only_the_lane_they_take(
    dbq: DbQueue,
) -> None:
    """Number 1 is taken by a push still in its transaction, 2 and 3 are written. Pops of one take 2
    and 3 past it; a pop of one in a caller's transaction locks only the lane it takes, so once the
    push commits another pop gets 1 while that transaction is still open."""
    q = ring(dbq, "lanes_one", 16, lanes=4)
    sent = {1: "x", 2: "a", 3: "b", 4: "c"}
    got: dict[int, Any] = {}
    with contextlib.ExitStack() as pushing, dbq.transaction() as caller:
        pusher = pushing.enter_context(dbq.transaction())
        assert q.push("x", conn=pusher) == 1
        assert [q.push(p) for p in ("a", "b")] == [2, 3]
        got.update((m.id, m.payload) for m in q.pop(1))
        assert list(got) == [2]  # lane 1 stops at 1, unwritten: lane 2 gives 2
        assert q.push("c") == 4
        mine = q.pop(1, semantics="exactly-once", conn=caller)
        assert [m.id for m in mine] == [3]
        got.update((m.id, m.payload) for m in mine)
        pushing.close()  # the push of 1 commits
        more = q.pop(1)  # lane 1 was passed over by the caller's pop, not locked by it
        assert [m.id for m in more] == [1]
        got.update((m.id, m.payload) for m in more)
    got.update((m.id, m.payload) for m in drain(q))
    assert got == sent
    st = q.stats()
    assert (st.ready, st.in_flight, st.extra["ring_used"]) == (0, 0, 0), st


def test_stats_of_a_deep_ring_counts_its_lanes_and_says_when_it_estimates(
    pg_dsn: str, schema_name: str
) -> None:
    """Up to RING_STATS_EXACT_CAP numbers to take a ring's stats() counts the lanes' messages in their
    slots; above it the lanes' depth by arithmetic stands for them (exact here: no gaps, no push in
    progress) and extra["estimated"] says so, with the oldest age read from the lanes' heads. Both
    agree with what the pops then take, which is every message pushed once (counted and checksummed)."""
    from airflow_dbqueue.engine.ring_inspect import RING_STATS_EXACT_CAP

    n = RING_STATS_EXACT_CAP + 5_000
    with DbQueue(pg_dsn, schema=schema_name) as dbq:
        dbq.install()
        q = dbq.create_queue(
            "deep",
            design="ring",
            layout="slots",
            capacity=n + 1_000,
            payload_type="bytes",
            max_payload_bytes=64,
        )
        sent = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]
        for k in range(0, n, 5_000):
            q.push_batch(sent[k : k + 5_000])
        deep = q.stats()
        assert deep.ready == n and type(deep.ready) is int and deep.extra.get("estimated") is True, deep
        assert deep.oldest_ready_age_s is not None and deep.oldest_ready_age_s >= 0
        counted = q.stats(exact=True)
        assert counted.ready == n and "estimated" not in counted.extra, counted
        got = q.pop_payloads(10_000)
        shallow = q.stats()
        assert shallow.ready == n - 10_000 and "estimated" not in shallow.extra, shallow
        while batch := q.pop_payloads(10_000):
            got.extend(batch)
        assert q.stats().ready == 0
        assert len(got) == n and sorted(got) == sorted(sent)
        dbq.uninstall()


@pytest.mark.parametrize("shape", ["plain", "group"])
def test_peek_shows_what_the_next_pop_takes_on_a_deep_ring(dbq: DbQueue, shape: str) -> None:
    """On a ring of 1,024 slots through which 3,000 messages pass in pushes of 1 to 40 (its window of
    waiting numbers goes round the end of the slots again and again), peek(n) shows exactly what the pop
    of n that follows takes (tests.helpers.peek_then_pop: the messages nacked to be delivered again
    first, then the lanes', none that an open lease holds, each with its deliveries so far), on the ring
    itself or on a consumer group, while the default group pops ahead of it. Every message is acked once
    by the reader (and taken once by the default group), counted and checksummed."""
    q = ring(dbq, "deep", 1024, lanes=4, max_attempts=10, retry_backoff=0)
    peek_then_pop(q, shape, total=3000, deep=700)


def test_a_peek_of_ten_reads_the_slots_of_ten_not_the_window(dbq: DbQueue) -> None:
    """A peek of 10 on a ring of 10,000 waiting messages (payloads of 300 bytes; the window of waiting
    numbers passes the end of the slots) reads about the slots of those 10, not every slot of the
    window: the ring's heap pages it fetches, counted by the server in the peek's transaction, are fewer
    than a tenth of the slots' pages. Every message is popped once, counted and checksummed."""
    postgres_only(dbq, "counts PostgreSQL's page fetches")
    q = ring(dbq, "deep", 12_000, payload_type="bytes", max_payload_bytes=512)
    sent = [i.to_bytes(4, "big") + b"x" * 296 for i in range(14_000)]
    got: list[Any] = []
    for k in range(0, 4_000, 1_000):
        q.push_batch(sent[k : k + 1_000])
        got += q.pop(1_000)
    for k in range(4_000, 14_000, 1_000):
        q.push_batch(sent[k : k + 1_000])
    qid = q.settings.queue_id
    with psycopg.connect(dbq.db.dsn) as c:  # type: ignore[attr-defined]
        slots = f'"{dbq.schema}".ring_slots'
        pages = c.execute("SELECT pg_relation_size(%s::regclass) / 8192", (slots,)).fetchone()[0]  # type: ignore[index]
        shown = c.execute(
            dbq.db.query("ring_peek"),  # type: ignore[attr-defined]
            {"queue_id": qid, "group": qid, "n": 10},
        ).fetchall()
        fetched = c.execute("SELECT pg_stat_get_xact_blocks_fetched(%s::regclass)", (slots,)).fetchone()[0]  # type: ignore[index]
    assert [bytes(r[-1]) for r in shown] == [m.payload for m in q.peek(10)] == sent[4_000:4_010]
    assert pages >= 500 and fetched < pages / 10, (fetched, pages)
    got += drain(q)
    assert len(got) == len(sent) and sorted(m.payload for m in got) == sent
