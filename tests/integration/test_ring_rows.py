"""The ring's rows layout (``create_queue(design="ring", layout="rows")``): what it does, what it refuses
by name (batches of a consumer group added by a build without them), its rotation under concurrent pushers
and pops, and its size under a held xmin horizon. Its batches run the batch tests of test_batches.py and
test_ring_batches.py; here, that claiming and finishing them writes no dead tuple under a held horizon.

The conformance suite (``test_conformance.py``) runs against it too, for what it supports; its consumer
groups are tested with the slots layout's, by the same tests (``test_ring_groups.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue.engine import (
    ConfigurationError,
    DbQueue,
    LeaseExpiredError,
    NotSupportedError,
    QueueFullError,
    QueueNotFoundError,
)
from tests.helpers import checksum, held_horizon

if TYPE_CHECKING:
    from collections.abc import Iterator

    from airflow_dbqueue.engine import Queue

pytestmark = pytest.mark.integration


def rows_ring(dbq: DbQueue, name: str = "r", **settings: Any) -> Queue:
    return dbq.create_queue(name, design="ring", layout="rows", **settings)


def drain(q: Queue, n: int = 100) -> list[Any]:
    out = []
    while batch := q.pop(n):
        out.extend(batch)
    return out


def test_a_ring_left_to_its_default_layout_is_of_the_rows_layout_on_postgresql(dbq: DbQueue) -> None:
    """PostgreSQL's default ring is the rows layout, with lanes its capacity can have; a shape only the
    slots layout can have is refused naming the way out, and made when asked for by name; a declaration
    that leaves the layout out matches an existing ring of either layout."""
    assert dbq.default_ring_layout == "rows"
    small = dbq.create_queue("small", design="ring", capacity=16)
    assert (small.settings.layout, small.settings.capacity, small.settings.lanes) == ("rows", 16, 2)
    big = dbq.create_queue("big", design="ring")
    assert (big.settings.layout, big.settings.capacity, big.settings.lanes) == ("rows", 16384, 8)
    with pytest.raises(ConfigurationError, match=r"multiple of 4 .* got 10 \(or choose layout='slots'\)"):
        dbq.create_queue("odd", design="ring", capacity=10)
    assert [q.name for q in dbq.list_queues()] == ["big", "small"]  # nothing made by the refusal
    odd = dbq.create_queue("odd", design="ring", capacity=10, layout="slots")
    assert (odd.settings.layout, odd.settings.lanes) == ("slots", 8)
    # declared again without a layout: each matches the ring it has, with that layout's defaults
    assert dbq.create_queue("odd", design="ring", capacity=10).settings == odd.settings
    assert dbq.create_queue("small", design="ring", capacity=16).settings == small.settings
    slots = dbq.create_queue("slots64", design="ring", capacity=64, layout="slots")
    assert dbq.create_queue("slots64", design="ring", capacity=64).settings == slots.settings
    sent = [{"i": i, "v": os.urandom(4).hex()} for i in range(40)]
    for q in (small, odd, slots):
        q.push_batch(sent[:8])
        got = drain(q)
        assert [m.payload for m in got] == sent[:8] and checksum([m.payload for m in got]) == checksum(
            sent[:8]
        )


def test_push_pop_in_id_order_with_counts_and_checksums(dbq: DbQueue) -> None:
    q = rows_ring(dbq, capacity=64, lanes=4)
    sent = [{"i": i, "s": "é✓" * (i % 5)} for i in range(700)]
    ids = q.push_batch(sent[:300]) + [q.push(p) for p in sent[300:320]] + q.push_batch(sent[320:])
    assert len(set(ids)) == 700 and ids == sorted(ids)
    assert q.stats().ready == 700
    got = drain(q, n=37)
    assert [m.id for m in got] == ids
    assert checksum(m.payload for m in got) == checksum(sent)
    s = q.stats()
    assert (s.ready, s.in_flight, s.failed, s.oldest_ready_age_s) == (0, 0, 0, None)


def test_refuses_what_it_does_not_build_by_name(dbq: DbQueue) -> None:
    """A group added by a build without batches (its copy lacks their functions: one is dropped here to
    make one) refuses them by name and takes nothing; bad settings are refused by name."""
    q = rows_ring(dbq, capacity=64, lanes=4)
    q.push_batch([1, 2])
    g = q.add_group("g", start="earliest")  # type: ignore[attr-defined]
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        c.execute(f'DROP FUNCTION "{dbq.schema}".{g._own()}bclaim')
    for call in (
        lambda: g.claim_batch(10),
        g.open_batches,
        lambda: g.get_batch("00000000-0000-0000-0000-000000000000"),
    ):
        with pytest.raises(NotSupportedError, match=r"group 'g' .* earlier build"):
            call()
    assert [m.payload for m in q.pop(10)] == [1, 2]  # nothing taken by the refusals
    assert [m.payload for m in g.pop(10)] == [1, 2]
    with pytest.raises(ConfigurationError, match="multiple of 4"):
        rows_ring(dbq, "bad", capacity=30, lanes=2)
    with pytest.raises(ConfigurationError, match="ring queues only"):
        dbq.create_queue("t", layout="rows")


class _RolledBack(Exception):
    pass


def _pusher(dbq: DbQueue, q: Queue, k: int, pushed: list[tuple[int, Any]]) -> None:
    """200 pushes of 1 to 4 messages; pusher 2 rolls every 25th back (a gap)."""
    for i in range(200):
        batch = [{"p": k, "i": i, "j": j} for j in range(1 + i % 4)]
        if k == 2 and i % 25 == 0:
            with pytest.raises(_RolledBack), dbq.transaction() as conn:
                q.push_batch(batch, conn=conn)
                raise _RolledBack
            continue
        pushed.extend(zip(q.push_batch(batch), batch, strict=True))


def _popper(dbq: DbQueue, q: Queue, k: int, popped: list[Any], pushing: threading.Event) -> None:
    """Pops of 7 until the pushers are done and 20 pops found nothing; pop 2 pops exactly once and rolls
    back the pops whose first id is a multiple of 5."""
    idle = 0
    while idle < 20 or pushing.is_set():
        if k == 2:
            try:
                with dbq.transaction() as conn:
                    got = q.pop(7, semantics="exactly-once", conn=conn)
                    if got and got[0].id % 5 == 0:
                        raise _RolledBack
            except _RolledBack:
                continue
        else:
            got = q.pop(7)
        popped.extend(got)
        idle = 0 if got else idle + 1
        if not got:
            time.sleep(0.01)


def test_rotation_under_concurrent_pushers_and_pops_loses_and_doubles_nothing(dbq: DbQueue) -> None:
    """Three pushers and three pops on a ring of 4 segments of 8 rows, for about 20 ring-sizes: one pusher
    rolls a push back now and then (a gap: its row number is never written), one pop pops exactly once
    and rolls back now and then (its messages come back). Every committed message is popped once."""
    q = rows_ring(dbq, capacity=32, lanes=2)
    pushed: list[list[tuple[int, Any]]] = [[] for _ in range(3)]
    popped: list[list[Any]] = [[] for _ in range(3)]
    errors: list[str] = []
    pushing = threading.Event()
    pushing.set()

    def run(target: Any, *args: Any) -> None:
        try:
            target(dbq, q, *args)
        except BaseException:
            errors.append(traceback.format_exc())

    pushers = [threading.Thread(target=run, args=(_pusher, k, pushed[k]), daemon=True) for k in range(3)]
    pops = [
        threading.Thread(target=run, args=(_popper, k, popped[k], pushing), daemon=True) for k in range(3)
    ]
    for t in pushers + pops:
        t.start()
    for t in pushers:
        t.join(120)
    pushing.clear()
    for t in pops:
        t.join(120)
    assert not [t.name for t in pushers + pops if t.is_alive()], "a thread still ran after 120 s"
    assert not errors, errors[0]
    sent = [m for p in pushed for m in p]
    got = [m for p in popped for m in p]
    assert sorted(m.id for m in got) == sorted(i for i, _ in sent)  # every message, none twice
    assert checksum(m.payload for m in got) == checksum(p for _, p in sent)
    assert len({i >> 16 for i, _ in sent}) > 32 * 15  # rows: the segments rotated many times
    assert q.stats().ready == 0


def _layout_figures(dbq: DbQueue, tables: str) -> tuple[int, int]:
    """(bytes, dead tuples) of the schema's tables whose names match the LIKE pattern ``tables``, with
    their indexes and TOAST tables, once the sessions' statistics are flushed."""
    time.sleep(1.5)  # a backend flushes its table statistics at most once a second, when idle
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0), "
            "coalesce(sum(pg_stat_get_dead_tuples(c.oid)), 0) FROM pg_class c "
            "WHERE c.relnamespace = %s::regnamespace AND c.relkind = 'r' AND c.relname LIKE %s",
            (dbq.schema, tables),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_held_horizon_leaves_no_dead_rows_and_a_bounded_size(dbq: DbQueue) -> None:
    """Under a REPEATABLE READ transaction held through a churn of 20 ring-sizes of pushes, the layout's
    tables stay within 1.5x their size after two ring-sizes, and hold no dead tuple: pushes and pops only
    insert, and whole segments are emptied with TRUNCATE. A slots ring with room for as many messages,
    churned alike, is printed beside it as a fact, not asserted."""
    rows = rows_ring(dbq, capacity=16, lanes=2)
    slots = dbq.create_queue("s", design="ring", layout="slots", capacity=160, lanes=2)
    payload = {"x": "y" * 200}
    holder = held_horizon(dbq.db.dsn)
    try:
        figures = {}
        for q, pattern in ((rows, f"ring\\_{rows.settings.queue_id}\\_r%"), (slots, "ring\\_slots")):
            sent = got = 0
            for size in range(20):
                for _ in range(16):
                    q.push_batch([payload] * 10)
                    sent += 10
                    got += len(q.pop(10))
                if size == 1:
                    before = _layout_figures(dbq, pattern)
            assert got == sent == 3200
            figures[q.name] = (before, _layout_figures(dbq, pattern))
        print(f"held horizon, 20 ring-sizes: (bytes, dead tuples) after 2 and after 20: {figures}")
        (size_before, _), (size_after, dead_after) = figures["r"]
        assert size_after <= 1.5 * size_before
        assert dead_after == 0
    finally:
        holder.close()


def test_a_full_ring_pushes_back_then_takes_pushes_again(dbq: DbQueue) -> None:
    """A ring of 8 rows (4 segments of 2) that nobody pops takes 8 pushes; the 9th waits its
    push_timeout and raises QueueFullError, pushing nothing; once popped, pushes go on."""
    q = rows_ring(dbq, capacity=8, lanes=1)
    q.push_timeout = 0.3  # type: ignore[attr-defined]
    sent = [[{"i": i, "j": j} for j in range(3)] for i in range(8)]
    for batch in sent:
        q.push_batch(batch)
    with pytest.raises(QueueFullError, match="stayed full"):
        q.push_batch([{"late": 1}])
    assert q.stats().ready == 24
    got = drain(q, n=5)
    assert checksum(m.payload for m in got) == checksum(p for b in sent for p in b)
    more = [{"more": i} for i in range(20)]
    for k in range(0, 20, 5):  # 4 pushes: the ring holds 8, every lane past the old ones
        q.push_batch(more[k : k + 5])
    assert [m.payload for m in drain(q, n=3)] == more


def _own_objects(dbq: DbQueue, queue_id: int) -> int:
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT (SELECT count(*) FROM pg_class WHERE relnamespace = %(s)s::regnamespace "
            "AND relname LIKE %(p)s) + (SELECT count(*) FROM pg_proc WHERE pronamespace = "
            "%(s)s::regnamespace AND proname LIKE %(p)s)",
            {"s": dbq.schema, "p": f"ring\\_{queue_id}\\_r%"},
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_drop_queue_and_uninstall_drop_the_rings_own_objects(dbq: DbQueue) -> None:
    q = rows_ring(dbq, capacity=64, lanes=4)
    q.push_batch([1, 2, 3])
    qid = q.settings.queue_id
    assert _own_objects(dbq, qid) > 20  # tables, indexes, sequences, a view, functions
    assert dbq.drop_queue("r")
    assert _own_objects(dbq, qid) == 0
    with pytest.raises(QueueNotFoundError):
        q.push(4)
    q2 = rows_ring(dbq, "r2", capacity=64, lanes=4)
    q2.push_batch([5])
    dbq.uninstall()
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        assert c.execute("SELECT to_regnamespace(%s)", (dbq.schema,)).fetchone() == (None,)


# -- at least once ---------------------------------------------------------------------------------

_CONSUMER = """
import sys, time
from airflow_dbqueue.engine import DbQueue
with DbQueue(sys.argv[1], schema=sys.argv[2]) as dbq:
    q = dbq.queue("r")
    got = q.pop(30, semantics="at-least-once", visibility_timeout=float(sys.argv[3]), consumer="doomed")
    print(" ".join(str(m.id) for m in got), flush=True)
    time.sleep(600)  # killed mid-lease, before any ack
"""


def test_redelivery_after_a_consumer_killed_mid_lease(dbq: DbQueue) -> None:
    """A consumer process pops 30 messages at least once and is killed with SIGKILL before it acks: once
    their lease ends, readiness counts them at once (before any reclaim), a pop reclaims them and they
    come out again (attempt 2) in id order, before the messages never delivered; every message is acked
    once, counted and checksummed."""
    q = rows_ring(dbq, capacity=64, lanes=4)
    sent = [{"i": i, "pad": "p" * (i % 7)} for i in range(100)]
    ids = q.push_batch(sent[:50]) + q.push_batch(sent[50:])
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONSUMER, dbq.db.dsn, dbq.schema, "1.0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        leased = [int(x) for x in proc.stdout.readline().split()]
        assert leased == ids[:30]
        assert q.stats().in_flight == 30
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    time.sleep(1.2)
    # Nothing reclaimed the lease yet (no pop, no maintenance): what observers wait on counts its 30
    # messages at once, the head the first of them, delivered once; stats and peek show them in flight.
    assert q.readiness() == (100, (ids[0], 1)) and q.count_ready() == 100 and q.count_ready(cap=40) == 40
    s = q.stats()
    assert (s.ready, s.in_flight) == (70, 30)
    assert [m.receipt for m in q.peek(2)] == [(ids[30], 0), (ids[31], 0)]
    acked: list[Any] = []
    first = q.pop(40, semantics="at-least-once")
    assert [m.id for m in first[:30]] == leased and all(m.attempts == 2 for m in first[:30])
    assert all(m.attempts == 1 for m in first[30:])
    assert q.ack(first) == len(first)
    acked += first
    while batch := q.pop(25, semantics="at-least-once"):
        assert q.ack(batch) == len(batch)
        acked += batch
    assert sorted(m.id for m in acked) == sorted(ids)
    assert checksum(m.payload for m in acked) == checksum(sent)
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 0, 0, 0)


def test_max_attempts_fails_the_message_and_a_late_ack_is_refused(dbq: DbQueue) -> None:
    """A message nacked max_attempts times goes to the failed state with its payload; a consumer whose
    lease ran out and was redelivered to another gets LeaseExpiredError for its late ack, changing
    nothing, while the other's ack counts."""
    q = rows_ring(dbq, capacity=64, lanes=2, max_attempts=2, retry_backoff=0, retry_backoff_max=0)
    sent = [{"k": i} for i in range(6)]
    ids = q.push_batch(sent)
    finished: list[Any] = []
    [poison] = q.pop(1, semantics="at-least-once")
    assert q.nack([poison], error="bad 1") == 1
    [poison] = q.pop(1, semantics="at-least-once")
    assert (poison.id, poison.attempts) == (ids[0], 2)
    assert q.nack([poison], error="bad 2") == 1
    [f] = q.list_failed()
    assert (f.id, f.attempts, f.payload, f.last_error) == (ids[0], 2, sent[0], "bad 2")
    slow = q.pop(2, semantics="at-least-once", visibility_timeout=0.2)
    time.sleep(0.3)
    assert q.reclaim_expired() == 2
    fast = q.pop(2, semantics="at-least-once")
    assert [(m.id, m.attempts) for m in fast] == [(m.id, 2) for m in slow]
    with pytest.raises(LeaseExpiredError) as late:
        q.ack(slow)
    assert sorted(late.value.ids) == sorted(m.id for m in slow)
    assert q.ack(fast) == 2
    finished += fast
    rest = q.pop(10, semantics="at-least-once")
    assert q.ack(rest) == 3
    finished += rest
    assert sorted(m.id for m in finished) == ids[1:]
    assert checksum([*(m.payload for m in finished), f.payload]) == checksum(sent)
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 0, 0, 1)


def test_a_message_to_deliver_again_keeps_its_segment(dbq: DbQueue) -> None:
    """A nacked message due in 1.5 s holds its segment: pushes fill the ring and then wait (QueueFullError
    after push_timeout) instead of emptying the segment under it; once it is delivered again and acked,
    the segment is emptied and pushes go on. Every message comes out, counted and checksummed."""
    q = rows_ring(dbq, capacity=8, lanes=1)
    q.push_timeout = 0.3  # type: ignore[attr-defined]
    sent = [{"i": i} for i in range(8)]
    for p in sent:
        q.push_batch([p])
    [held] = q.pop(1, semantics="at-least-once")
    assert q.nack([held], delay=1.5) == 1
    out = drain(q, n=10)  # the other 7, at most once
    assert len(out) == 7
    with pytest.raises(QueueFullError):
        q.push_batch([{"late": 1}])  # its segment would be emptied: it still holds a message
    time.sleep(1.5)
    [again] = q.pop(1, semantics="at-least-once")
    assert (again.id, again.attempts, again.payload) == (held.id, 2, sent[0])
    assert q.ack([again]) == 1
    out.append(again)
    more = [{"more": i} for i in range(8)]
    for half in (more[:4], more[4:]):  # a segment's worth of pushes a round, popped between
        for p in half:
            q.push_batch([p])
        out += drain(q, n=10)
    assert checksum(m.payload for m in out) == checksum(sent + more)
    assert q.stats().ready == 0


def _alo_pusher(q: Queue, k: int, pushed: list[tuple[int, Any]]) -> None:
    for i in range(150):
        batch = [{"p": k, "i": i, "j": j} for j in range(1 + i % 3)]
        pushed.extend(zip(q.push_batch(batch), batch, strict=True))


def _alo_consumer(q: Queue, k: int, acked: list[Any], pushing: threading.Event) -> None:
    """At least once: consumer 0 acks every pop; 1 nacks every third pop whole; 2 acks the first half of
    each pop and nacks the rest."""
    idle = n = 0
    while idle < 30 or pushing.is_set():
        got = q.pop(5, semantics="at-least-once")
        n += 1
        idle = 0 if got else idle + 1
        if not got:
            time.sleep(0.01)
            continue
        if k == 1 and n % 3 == 0:
            assert q.nack(got) == len(got)
        elif k == 2 and len(got) > 1:
            half = len(got) // 2
            assert q.ack(got[:half]) == half
            assert q.nack(got[half:]) == len(got) - half
            acked.extend(got[:half])
        else:
            assert q.ack(got) == len(got)
            acked.extend(got)


def test_at_least_once_through_rotations_loses_and_doubles_nothing(dbq: DbQueue) -> None:
    """Three pushers and three consumers at least once on a ring of 4 segments of 8 rows, for about 18
    ring-sizes, with nacks of whole pops and of parts of pops (max_attempts 4, no backoff): every message
    is acked once or failed, none lost, the segments rotating under messages to deliver again."""
    q = rows_ring(dbq, capacity=32, lanes=2, max_attempts=4, retry_backoff=0, retry_backoff_max=0)
    pushed: list[list[tuple[int, Any]]] = [[] for _ in range(3)]
    acked: list[list[Any]] = [[] for _ in range(3)]
    errors: list[str] = []
    pushing = threading.Event()
    pushing.set()

    def run(target: Any, *args: Any) -> None:
        try:
            target(q, *args)
        except BaseException:
            errors.append(traceback.format_exc())

    pushers = [threading.Thread(target=run, args=(_alo_pusher, k, pushed[k]), daemon=True) for k in range(3)]
    consumers = [
        threading.Thread(target=run, args=(_alo_consumer, k, acked[k], pushing), daemon=True)
        for k in range(3)
    ]
    for t in pushers + consumers:
        t.start()
    for t in pushers:
        t.join(180)
    pushing.clear()
    for t in consumers:
        t.join(180)
    assert not [t.name for t in pushers + consumers if t.is_alive()], "a thread still ran after 180 s"
    assert not errors, errors[0]
    sent = dict(m for p in pushed for m in p)
    done = [m for a in acked for m in a]
    failed = q.list_failed(limit=100_000)
    assert len({m.id for m in done}) == len(done)  # none acked twice
    assert sorted([m.id for m in done] + [f.id for f in failed]) == sorted(sent)
    assert checksum([m.payload for m in done] + [f.payload for f in failed]) == checksum(sent.values())
    assert len({i >> 16 for i in sent}) > 32 * 13  # rows: the segments rotated many times
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 0, 0, len(failed))


def _segment_files(dsn: str, schema: str, kinds: str) -> dict[str, tuple[int, int]]:
    """(relfilenode, rows) of each segment table of the schema's one rows ring whose kind (the letters
    after ``_r``: q, pos, l, d, r) is in ``kinds``."""
    with psycopg.connect(dsn, autocommit=True) as c:
        [qid] = c.execute(f'SELECT queue_id FROM "{schema}".ring_rows').fetchone() or [None]
        out = {}
        for kind in kinds.split():
            for k in range(4):
                name = f"ring_{qid}_r{kind}{k}"
                row = c.execute(
                    "SELECT (SELECT relfilenode FROM pg_class WHERE oid = %s::regclass), "
                    f'count(*) FROM "{schema}"."{name}"',
                    (f'"{schema}"."{name}"',),
                ).fetchone()
                assert row is not None
                out[name] = (int(row[0]), int(row[1]))
    return out


def test_rotation_empties_the_logs_written_and_leaves_empty_ones_alone(dbq: DbQueue) -> None:
    """A rotation gives the messages and positions of the segment it empties new files, and the leases,
    done rows and retry log only when something was written in them: at most once they keep their files
    (no new pg_class row versions for them, which a held horizon would keep); at least once the leases
    and done rows of a passed segment are emptied with it. Every message once, in order, throughout."""
    q = rows_ring(dbq, capacity=64, lanes=4)  # 4 segments of 16 pushes
    schema = dbq.db.schema
    before = _segment_files(dbq.db.dsn, schema, "q pos l d r")
    sent = [{"i": i} for i in range(200 * 5)]
    got: list[Any] = []
    for k in range(200):  # 200 pushes of 5 (about 3 ring-sizes), each popped at once
        q.push_batch(sent[5 * k : 5 * k + 5])
        got.extend(q.pop(5))
    assert [m.payload for m in got] == sent and checksum(m.payload for m in got) == checksum(sent)
    after = _segment_files(dbq.db.dsn, schema, "q pos l d r")
    kind = {name: name.split("_r")[-1][:-1] for name in after}
    assert all(after[n][0] != before[n][0] for n in after if kind[n] in ("q", "pos")), (before, after)
    assert all(after[n] == before[n] for n in after if kind[n] in ("l", "d", "r")), (before, after)
    alo = [{"j": i} for i in range(200 * 5)]
    acked: list[Any] = []
    for k in range(200):
        q.push_batch(alo[5 * k : 5 * k + 5])
        msgs = q.pop(5, semantics="at-least-once")
        q.ack(msgs)
        acked.extend(msgs)
    assert [m.payload for m in acked] == alo and checksum(m.payload for m in acked) == checksum(alo)
    last = _segment_files(dbq.db.dsn, schema, "l d")
    # 200 leases and done rows were written; a segment holds at most its 16 pushes' worth of each: the
    # older ones went with their segments
    assert sum(rows for _, rows in last.values()) <= 2 * 4 * 16, last
    assert all(last[n][0] != after[n][0] for n in last), (after, last)


def _write_counts(dsn: str, schema: str, pattern: str) -> dict[str, tuple[int, int, int, int]]:
    """(inserted, updated, deleted, dead) tuples of each table of ``schema`` matching LIKE ``pattern``,
    from the statistics every session has flushed."""
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT relname, n_tup_ins, n_tup_upd + n_tup_hot_upd, n_tup_del, n_dead_tup "
            "FROM pg_stat_user_tables WHERE schemaname = %s AND relname LIKE %s",
            (schema, pattern),
        ).fetchall()
    return {r[0]: (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}


def _flush_stats(dsn: str, schema: str, churn: Any) -> None:
    """Run ``churn(q_handle_factory)`` on a DbQueue of one pooled session, then make that session flush
    its table statistics (pg_stat_force_next_flush: it flushes once it goes idle after that call)."""
    with DbQueue(dsn, schema=schema, pool_size=1) as one:
        churn(one)
        with one.db.transaction() as conn:
            conn.execute("SELECT pg_stat_force_next_flush()")
        with one.db.transaction() as conn:
            conn.execute("SELECT 1")
    time.sleep(0.2)


def test_held_horizon_at_least_once_writes_no_dead_tuple(dbq: DbQueue) -> None:
    """While a REPEATABLE READ transaction holds the xmin horizon, pops at least once with acks of whole
    pops, acks and nacks of parts of pops, redeliveries and a reclaimed lease only insert into the rows
    ring's tables: no tuple updated, deleted or dead in any of them. The slots ring, driven alike in the
    same hold, deletes its lease rows (its dead tuples are counted by the same statistics: they are
    what shows that the count works)."""
    rows = rows_ring(dbq, capacity=1024, lanes=2, max_attempts=3, retry_backoff=0, retry_backoff_max=0)
    dbq.create_queue(
        "s", design="ring", layout="slots", capacity=4096, lanes=2, retry_backoff=0, retry_backoff_max=0
    )
    sent = [{"n": i, "pad": "x" * 50} for i in range(400)]
    holder = held_horizon(dbq.db.dsn, xid=True)
    finished: dict[str, list[Any]] = {"r": [], "s": []}

    def churn(one: DbQueue) -> None:
        for name in ("r", "s"):
            q = one.queue(name)
            for k in range(0, 400, 20):
                q.push_batch(sent[k : k + 20])
            while got := q.pop(15, semantics="at-least-once"):
                if got[0].attempts == 1 and got[0].id % 3 == 0:
                    q.ack(got[:5])
                    q.nack(got[5:])
                    finished[name] += got[:5]
                else:
                    q.ack(got)
                    finished[name] += got
            expiring = q.push_batch([{"last": 1}])
            [m] = q.pop(1, semantics="at-least-once", visibility_timeout=0.1)
            time.sleep(0.2)
            assert q.reclaim_expired() == 1
            [again] = q.pop(1, semantics="at-least-once")
            assert (again.id, again.attempts) == (m.id, 2) and [m.id] == expiring
            q.ack([again])
            finished[name].append(again)

    try:
        _flush_stats(dbq.db.dsn, dbq.schema, churn)
        counts = _write_counts(dbq.db.dsn, dbq.schema, f"ring\\_{rows.settings.queue_id}\\_r%")
        slot_counts = _write_counts(dbq.db.dsn, dbq.schema, "ring\\_%")
    finally:
        holder.close()
    for name in ("r", "s"):
        assert checksum(m.payload for m in finished[name]) == checksum([*sent, {"last": 1}])
        assert len(finished[name]) == 401
    print(f"rows ring's tables under the hold (ins, upd, del, dead): {counts}")
    inserted = {name[len(f"ring_{rows.settings.queue_id}_r") :]: c[0] for name, c in counts.items()}
    assert sum(inserted[f"l{k}"] for k in range(4)) > 20  # the statistics were flushed: leases written
    assert sum(inserted[f"r{k}"] for k in range(4)) > 100  # and retry rows (nacks, splits, the reclaim)
    assert {name: c[1:] for name, c in counts.items() if c[1:] != (0, 0, 0)} == {}
    slots_changed = sum(
        c[2] + c[3] for name, c in slot_counts.items() if name in ("ring_leases", "ring_retry")
    )
    assert slots_changed > 0, slot_counts


def test_a_pop_at_most_once_takes_a_message_due_again_first(dbq: DbQueue) -> None:
    """A nacked message is delivered again before the messages never delivered, whatever the next pop's
    semantics: at most once it is then finished (attempt 2), and never comes out again."""
    q = rows_ring(dbq, capacity=64, lanes=2, retry_backoff=0, retry_backoff_max=0)
    sent = [{"m": i} for i in range(5)]
    ids = q.push_batch(sent)
    first = q.pop(2, semantics="at-least-once")
    assert q.ack(first[1:]) == 1
    assert q.nack(first[:1]) == 1
    got = q.pop(10)
    assert [(m.id, m.attempts) for m in got] == [(ids[0], 2), *((i, 1) for i in ids[2:])]
    assert q.pop(10, semantics="at-least-once") == []
    assert checksum([*(m.payload for m in got), first[1].payload]) == checksum(sent)
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 0, 0, 0)


def test_parts_of_one_pop_settled_at_once_from_two_threads(dbq: DbQueue) -> None:
    """Two threads settle the two halves of one pop at the same moment, one acking and one nacking, 30
    times: each split of the lease waits for the other's, and both settles count their half (neither is
    refused as lost); the nacked halves come out again once, and every message is acked once."""
    q = rows_ring(dbq, capacity=256, lanes=2, retry_backoff=0, retry_backoff_max=0)
    sent = [{"r": r, "i": i} for r in range(30) for i in range(10)]
    done: list[Any] = []
    errors: list[str] = []
    for r in range(30):
        q.push_batch(sent[10 * r : 10 * r + 10])
        got = q.pop(10, semantics="at-least-once")
        assert len(got) == 10
        start = threading.Barrier(2)
        counts: list[int] = []

        def settle(part: list[Any], nack: bool, start: threading.Barrier, counts: list[int]) -> None:
            try:
                start.wait(10)
                counts.append(q.nack(part) if nack else q.ack(part))
            except BaseException:
                errors.append(traceback.format_exc())

        threads = [
            threading.Thread(target=settle, args=(got[:5], False, start, counts)),
            threading.Thread(target=settle, args=(got[5:], True, start, counts)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors[0]
        assert counts == [5, 5]
        done += got[:5]
        again = q.pop(10, semantics="at-least-once")
        assert [(m.id, m.attempts) for m in again] == [(m.id, 2) for m in got[5:]]
        assert q.ack(again) == 5
        done += again
    assert sorted(m.id for m in done) == sorted({m.id for m in done}) and len(done) == 300
    assert checksum(m.payload for m in done) == checksum(sent)
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 0, 0, 0)


# Says "ready" once it can pop, before the test starts pushing (its start-up can outlast the pushes on a
# loaded machine), and pops until the test writes a line (the pushes are over) and then 40 pops in a row
# find nothing.
_ONE_CONSUMER = """
import json, select, sys, time
from airflow_dbqueue.engine import DbQueue
got, idle, pushing = [], 0, True
with DbQueue(sys.argv[1], schema=sys.argv[2]) as dbq:
    q = dbq.queue("one")
    got += [[m.id, m.payload] for m in q.pop(1)]  # nothing is pushed before "ready"
    print("ready", flush=True)
    while pushing or idle < 40:
        batch = q.pop(1)
        got += [[m.id, m.payload] for m in batch]
        idle = 0 if batch else idle + 1
        if not batch:
            time.sleep(0.02)
        if pushing and select.select([sys.stdin], [], [], 0)[0]:
            pushing = not sys.stdin.readline()
print(json.dumps(got), flush=True)
"""


def test_pops_of_one_by_threads_and_a_process_take_every_message_once(  # noqa: PLR0915
    dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pushers push one message at a time, 400 each, into a ring of 4 segments of 16 rows (about 12
    ring-sizes), while pops of one take them: two threads at most once, one at least once acking each
    message, one exactly once in a transaction rolled back now and then, and a process of its own. Every
    message comes out once (counted and checksummed), in id order within each consumer's lane, and the
    pops of one went through the ring's own one-message function (the fast path)."""
    q = rows_ring(dbq, "one", capacity=64, lanes=4)
    names: list[str] = []
    fetchall = dbq.db.fetchall

    def recording(name: str, *args: Any, **kwargs: Any) -> Any:
        names.append(name)
        return fetchall(name, *args, **kwargs)

    monkeypatch.setattr(dbq.db, "fetchall", recording)
    pushed: list[list[tuple[int, Any]]] = [[], []]
    popped: list[list[Any]] = [[] for _ in range(4)]
    errors: list[str] = []
    pushing = threading.Event()
    pushing.set()

    def push(k: int) -> None:
        for i in range(400):
            p = {"k": k, "i": i, "pad": "é" * (i % 9)}
            pushed[k].append((q.push(p), p))

    def pop(k: int) -> None:
        idle = 0
        while idle < 40 or pushing.is_set():
            if k == 2:
                got = q.pop(1, semantics="at-least-once")
                assert q.ack(got) == len(got)
            elif k == 3:
                try:
                    with dbq.transaction() as conn:
                        got = q.pop(1, semantics="exactly-once", conn=conn)
                        if got and got[0].id % 7 == 0 and got[0].id not in rolled:
                            rolled.add(got[0].id)
                            raise _RolledBack
                except _RolledBack:
                    continue
            else:
                got = q.pop(1)
            popped[k].extend((m.id, m.payload) for m in got)
            idle = 0 if got else idle + 1
            if not got:
                time.sleep(0.01)

    def run(target: Any, k: int) -> None:
        try:
            target(k)
        except BaseException:
            errors.append(traceback.format_exc())

    rolled: set[int] = set()
    proc = subprocess.Popen(
        [sys.executable, "-c", _ONE_CONSUMER, dbq.db.dsn, dbq.schema],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "ready\n"
        threads = [threading.Thread(target=run, args=(push, k), daemon=True) for k in range(2)]
        consumers = [threading.Thread(target=run, args=(pop, k), daemon=True) for k in range(4)]
        for t in threads + consumers:
            t.start()
        for t in threads:
            t.join(120)
        pushing.clear()
        proc.stdin.write("pushed\n")
        proc.stdin.flush()
        for t in consumers:
            t.join(120)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait(30)
    assert not [t.name for t in threads + consumers if t.is_alive()], "a thread still ran after 120 s"
    assert not errors, errors[0]
    by_process = [(int(i), p) for i, p in json.loads(out)]
    sent = [m for p in pushed for m in p]
    got = [m for p in popped for m in p] + by_process
    assert sorted(i for i, _ in got) == sorted(i for i, _ in sent)  # every message, none twice
    assert checksum(p for _, p in got) == checksum(p for _, p in sent)
    for mine in [*popped, by_process]:  # each consumer saw each lane in id order
        for lane in range(4):
            ids = [i for i, _ in mine if (i >> 16) % 4 == lane]
            assert ids == sorted(ids)
    assert len(by_process) > 0 and all(popped), [len(p) for p in popped]
    assert rolled, "no exactly-once pop was rolled back"
    assert len({i >> 16 for i, _ in sent}) > 64 * 10  # rows: the segments rotated many times
    # every message a thread took came from a call of the one-message function, empty calls besides
    assert names.count("ring_rows_take_one") >= sum(map(len, popped)) > 0
    assert "ring_rows_take" not in names
    s = q.stats()
    assert (s.ready, s.in_flight, s.failed) == (0, 0, 0)


def test_one_consumers_pops_of_one_come_in_push_order_across_segments(dbq: DbQueue) -> None:
    """One consumer's pops of one take the lowest lane whose row is written: rows of one message, dealt in
    turn to 4 lanes, come out in push order through about 30 segments of 16 rows, at most once and at
    least once (each acked), with a pop of 3 (the general pop) now and then. Where the pops cross into a
    segment, some lanes' positions are logged in the newest segment of the log and the others' still in
    the one before: a pop of one that read only the newest would take a lane ahead of a lower one there."""
    q = rows_ring(dbq, "order", capacity=64, lanes=4)
    sent: list[tuple[int, Any]] = []
    got: list[tuple[int, Any]] = []
    for rnd in range(40):
        batch = [{"r": rnd, "i": i} for i in range(12)]
        sent += [(q.push(p), p) for p in batch]
        left = 12
        while left:
            if rnd % 5 == 4 and left == 12:
                msgs = q.pop(3)
            elif left % 2:
                msgs = q.pop(1, semantics="at-least-once")
                assert q.ack(msgs) == len(msgs)
            else:
                msgs = q.pop(1)
            assert msgs, (rnd, left)
            got += [(m.id, m.payload) for m in msgs]
            left -= len(msgs)
    assert q.pop(1) == []
    assert [i for i, _ in got] == [i for i, _ in sent]
    assert checksum(p for _, p in got) == checksum(p for _, p in sent)
    assert len({i >> 16 for i, _ in sent}) == 480  # rows: 30 segments of 16


def test_recover_gaps_gives_up_a_rolled_back_push_once_no_older_transaction_runs(dbq: DbQueue) -> None:
    """A push that rolled back leaves its row unwritten and its lane stopped there. recover_gaps leaves
    it while a transaction older than its look runs (a push still holding its row: it waits ``wait``
    seconds and gives nothing up), then gives it up (1 row), so that one pop takes every message, in
    id order; a bad ``wait`` is refused by name, nothing given up. maintain() gives up the next one."""
    q = rows_ring(dbq, "gaps", capacity=64, lanes=4)
    sent = [{"i": i} for i in range(10)]
    ids = [q.push(p) for p in sent[:3]]
    with pytest.raises(_RolledBack), dbq.transaction() as conn:
        q.push({"lost": True}, conn=conn)
        raise _RolledBack
    ids += [q.push(p) for p in sent[3:]]
    with pytest.raises(ConfigurationError, match="recover_gaps wait"):
        q.recover_gaps(wait=-1)  # type: ignore[attr-defined]
    with dbq.transaction() as conn:
        ids.append(q.push({"late": True}, conn=conn))  # a push holding its row, running
        t0 = time.monotonic()
        assert q.recover_gaps(wait=0.3) == 0  # type: ignore[attr-defined]
        assert time.monotonic() - t0 >= 0.3
    assert q.recover_gaps(wait=5.0) == 1  # type: ignore[attr-defined]
    assert q.recover_gaps(wait=5.0) == 0  # type: ignore[attr-defined]
    got = q.pop(100)  # one pop: no lane stops at the gap any more
    assert [m.id for m in got] == ids
    assert checksum(m.payload for m in got) == checksum([*sent, {"late": True}])
    assert q.maintain()["gaps_skipped"] == 0  # type: ignore[attr-defined]
    # maintain() (the upkeep's path) gives up a gap at a lane's head too, without waiting: each call
    # proves what the call before it looked at, so the gap made after the last look goes on the second
    # (or a later one, if another transaction with an xid, an autoanalyze writing its statistics, was
    # running at a look: it is among those the next call must find gone)
    with pytest.raises(_RolledBack), dbq.transaction() as conn:
        q.push({"lost": 2}, conn=conn)
        raise _RolledBack
    more = [q.push({"m": i}) for i in range(4)]  # the last one is behind the gap, in its lane
    assert q.maintain()["gaps_skipped"] == 0  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10.0
    while not (skipped := q.maintain()["gaps_skipped"]) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    assert skipped == 1
    assert [m.id for m in q.pop(10)] == more


def test_held_horizon_pops_of_one_write_no_dead_tuple(dbq: DbQueue) -> None:
    """While a REPEATABLE READ transaction holds the xmin horizon, pushes of one and pops of one (at most
    once, and at least once with each message acked) through several rotations only insert into the rows
    ring's tables: no tuple updated, deleted or dead in any of them; the slots ring, driven alike in the
    same hold, updates its lanes (what shows that the count works)."""
    rows = rows_ring(dbq, capacity=32, lanes=2)
    dbq.create_queue("s", design="ring", layout="slots", capacity=64, lanes=2)
    sent = [{"n": i, "pad": "x" * (i % 40)} for i in range(300)]
    holder = held_horizon(dbq.db.dsn, xid=True)
    finished: dict[str, list[Any]] = {"r": [], "s": []}

    def churn(one: DbQueue) -> None:
        for name in ("r", "s"):
            q = one.queue(name)
            for k, p in enumerate(sent):
                q.push(p)
                if k % 2:
                    finished[name] += [m.payload for m in q.pop(1)]
                else:
                    got = q.pop(1, semantics="at-least-once")
                    assert q.ack(got) == len(got)
                    finished[name] += [m.payload for m in got]

    try:
        _flush_stats(dbq.db.dsn, dbq.schema, churn)
        counts = _write_counts(dbq.db.dsn, dbq.schema, f"ring\\_{rows.settings.queue_id}\\_r%")
        slot_counts = _write_counts(dbq.db.dsn, dbq.schema, "ring\\_%")
    finally:
        holder.close()
    for name in ("r", "s"):
        assert len(finished[name]) == 300
        assert checksum(finished[name]) == checksum(sent)
    print(f"rows ring's tables under the hold, pops of one (ins, upd, del, dead): {counts}")
    inserted = {name[len(f"ring_{rows.settings.queue_id}_r") :]: c[0] for name, c in counts.items()}
    assert sum(inserted[f"l{k}"] for k in range(4)) > 100  # the statistics were flushed: leases written
    assert sum(inserted[f"pos{k}"] for k in range(4)) > 250  # and a lane position a pop
    assert {name: c[1:] for name, c in counts.items() if c[1:] != (0, 0, 0)} == {}
    assert slot_counts["ring_lanes"][1] > 0, slot_counts


def test_a_ring_made_before_the_pop_of_one_function_pops_one_by_the_general_path(dbq: DbQueue) -> None:
    """A ring whose functions were made by a build without the pop-of-one function (dropped here to make
    one) still pops one at a time, through the general pop, every message once."""
    q = rows_ring(dbq, "old", capacity=64, lanes=2)
    sent = [{"i": i} for i in range(30)]
    for p in sent:
        q.push(p)
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        c.execute(f'DROP FUNCTION "{dbq.schema}".ring_{q.settings.queue_id}_rtake1')
    old = dbq.queue("old")
    got = [m.payload for _ in range(10) for m in old.pop(1)]
    leased = [m for _ in range(10) for m in old.pop(1, semantics="at-least-once")]
    assert old.ack(leased) == 10
    got += [m.payload for m in leased] + [p for _ in range(10) for p in old.pop_payloads(1)]
    assert got == sent
    assert old.pop(1) == []


@pytest.mark.parametrize("shape", ["plain", "per_key", "group"])
def test_peek_shows_what_the_next_pop_takes_on_a_deep_ring(dbq: DbQueue, shape: str) -> None:
    """On a ring of 2,000 messages in pushes of 1 to 40 (plain, ordered per key, or a consumer group of
    a plain ring), peek(n) shows exactly what the pop of n that follows takes, in its order, each with
    its deliveries so far: first the messages nacked to be delivered again, then the lanes', and on the
    ordered ring only those of the lanes no open lease holds. Leases stay open a few pops, some messages
    are nacked (delivered again); every message is acked once, counted and checksummed."""
    rng = random.Random(f"peek-{shape}")
    q = rows_ring(
        dbq,
        capacity=4096,
        lanes=4,
        max_attempts=10,
        retry_backoff=0,
        **({"ordering": "per_key"} if shape == "per_key" else {}),
    )
    reader = q.add_group("g", start="earliest") if shape == "group" else q  # type: ignore[attr-defined]
    sent: list[Any] = []
    while len(sent) < 2000:
        batch = [{"i": len(sent) + i, "pad": "p" * rng.randrange(300)} for i in range(rng.randint(1, 40))]
        keys = [f"k{m['i'] % 37}" for m in batch] if shape == "per_key" else None
        q.push_batch(batch, keys=keys)
        sent += batch
    acked: list[Any] = []
    open_leases: list[list[Any]] = []
    pops = 0
    while True:
        n = rng.randint(4, 30)  # at least the lanes: a pop of n locks up to n of them
        shown = reader.peek(n)
        got = reader.pop(n, semantics="at-least-once")
        assert [(m.id, m.payload, m.delivery + 1) for m in shown] == [
            (m.id, m.payload, m.delivery) for m in got
        ]
        pops += 1
        if not got and not open_leases:
            break
        again = [m for m in got if m.delivery < 3 and rng.random() < 0.1]
        if again:
            assert reader.nack(again, delay=0) == len(again)
        rest = [m for m in got if m not in again]
        if rest:
            open_leases.append(rest)
        while open_leases and (not got or rng.random() < 0.5):  # leases stay open a few pops
            done = open_leases.pop(0)
            assert reader.ack(done) == len(done)
            acked += done
    assert pops > 100 and len(acked) == len(sent) == len({m.id for m in acked})
    assert checksum(m.payload for m in acked) == checksum(sent)
    assert reader.peek() == [] and reader.count_ready() == 0


@pytest.mark.parametrize("ordering", ["none", "per_key"])
def test_peek_of_ten_reads_the_payloads_of_ten_not_of_the_ring(dbq: DbQueue, ordering: str) -> None:
    """A peek of 10 on a ring of 10,000 waiting messages (100 pushes of 100 payloads of 300 bytes, each
    push's payloads stored out of line) reads the stored payloads of the rows holding those 10, not of
    the whole ring: the toast pages it fetches, counted by the server in the peek's transaction, are
    fewer than a tenth of the ring's (those of a few rows)."""
    q = rows_ring(dbq, capacity=4096, lanes=8, ordering=ordering, payload_type="bytes")
    sent = [i.to_bytes(4, "big") + b"x" * 296 for i in range(10_000)]
    for k in range(100):
        q.push_batch(
            sent[100 * k : 100 * (k + 1)],
            keys=[f"k{i % 1000}" for i in range(100)] if ordering == "per_key" else None,
        )
    own = f'"{dbq.schema}".{q._own()}'  # type: ignore[attr-defined]
    segments = ", ".join(f"'{own}q{k}'" for k in range(4))
    toast = f"ARRAY(SELECT c.reltoastrelid FROM pg_class c WHERE c.oid = ANY (ARRAY[{segments}]::regclass[]))"
    with psycopg.connect(dbq.db.dsn) as c:
        pages = c.execute(f"SELECT sum(pg_relation_size(t) / 8192) FROM unnest({toast}) t").fetchone()[0]
        qid = c.execute(f'SELECT queue_id FROM "{dbq.schema}".queues WHERE name = %s', (q.name,)).fetchone()[
            0
        ]
        shown = c.execute(
            f'SELECT r_id, r_payload FROM "{dbq.schema}".ring_rows_look(%s, 10)', (qid,)
        ).fetchall()
        fetched = c.execute(
            f"SELECT sum(pg_stat_get_xact_blocks_fetched(t)) FROM unnest({toast}) t"
        ).fetchone()[0]
    assert [p for _, p in shown] == [m.payload for m in q.peek(10)] and len(shown) == 10
    assert pages >= 300 and fetched < pages / 10, (fetched, pages)
    got = drain(q)
    assert len(got) == len(sent) and checksum(m.payload.hex() for m in got) == checksum(p.hex() for p in sent)


def test_a_ring_made_before_its_readiness_functions_is_observed_as_before(dbq: DbQueue) -> None:
    """A ring (and a group of it) whose functions were made by a build without ``look`` and ``ready``
    (dropped here to make one) is still peeked, with each message's attempts and deliveries so far, and
    observed: readiness counts what its ``depth`` counts ready (a lease past its end once reclaimed),
    its head the first message peek shows. Every message is taken once, counted and checksummed."""
    q = rows_ring(dbq, "old", capacity=64, lanes=2, retry_backoff=0)
    g = q.add_group("g", start="earliest")  # type: ignore[attr-defined]
    sent = [{"i": i} for i in range(6)]
    ids = q.push_batch(sent[:3]) + q.push_batch(sent[3:])
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        for own in (q._own(), g._own()):  # type: ignore[attr-defined]
            # Such a ring's peek reads the ring itself; this one's reads its look, kept under another name.
            fn = f'"{dbq.schema}".{own}'
            c.execute(f"ALTER FUNCTION {fn}look(integer) RENAME TO {own}look_kept")
            c.execute(
                f"CREATE OR REPLACE FUNCTION {fn}peek(p_n integer) RETURNS TABLE (r_id bigint, "
                "r_enqueued_at timestamptz, r_payload bytea) LANGUAGE sql AS "
                f"'SELECT k.r_id, k.r_enqueued_at, k.r_payload FROM {fn}look_kept(p_n) k'"
            )
            c.execute(f"DROP FUNCTION {fn}ready")
    old = dbq.queue("old")
    for h in (old, old.group("g")):  # type: ignore[attr-defined]
        assert [m.receipt for m in h.peek(10)] == [(i, 0) for i in ids]
        assert h.readiness() == (6, (ids[0], 0)) and h.count_ready(cap=4) == 4
        [m] = h.pop(1, semantics="at-least-once")
        assert h.nack([m], delay=0) == 1
        assert [(x.id, x.attempts, x.delivery) for x in h.peek(2)] == [(ids[0], 1, 1), (ids[1], 0, 0)]
        assert h.readiness() == (6, (ids[0], 1))
        got = drain(h)
        assert sorted(x.id for x in got) == ids and checksum(x.payload for x in got) == checksum(sent)
        assert h.readiness() == (0, None) and h.peek() == []


def test_held_horizon_batches_write_no_dead_tuple(dbq: DbQueue) -> None:  # noqa: PLR0915
    """While a REPEATABLE READ transaction holds the xmin horizon, batches claimed, read by their batch
    query, acked in the caller's transaction with its results, released and claimed again, extended and
    acked, through several rotations, by the ring's default group and by a group ``g`` (its own ledger),
    only insert into the rows ring's tables and the group's (their ledgers included): no tuple updated or
    deleted in any of them, and no dead one but the two rows of the one ack a group whose caller's
    transaction rolled back (its done row and its batch state row, dead from the start). The slots ring,
    driven alike in the same hold, updates its ledger rows in the schema's batches table (what shows
    that the count works). Every group of each ring acks every message once, counted and checksummed."""
    rows = rows_ring(dbq, capacity=16, lanes=2)
    group = rows.add_group("g")  # type: ignore[attr-defined]
    dbq.create_queue("s", design="ring", layout="slots", capacity=1024, lanes=2).add_group("g")  # type: ignore[attr-defined]
    sent = [{"n": i, "pad": "x" * (i % 30)} for i in range(600)]
    holder = held_horizon(dbq.db.dsn, xid=True)
    finished: dict[str, list[Any]] = {f"{n}.{g}": [] for n in ("r", "s") for g in ("default", "g")}

    def read(q: Queue, batch_id: str) -> list[Any]:
        with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
            return [json.loads(bytes(r[3])) for r in c.execute(q.batch_query(batch_id).encode())]

    def churn(one: DbQueue) -> None:
        for name in ("r", "s"):
            ring = one.queue(name)
            handles = {f"{name}.{g}": ring.group(g) for g in ("default", "g")}  # type: ignore[attr-defined]
            for k in range(0, 600, 10):
                ring.push_batch(sent[k : k + 10])
                for key, q in handles.items():  # both groups take each push before the next
                    b = q.claim_batch(12, consumer=f"spark.{k}")
                    assert b is not None
                    got = read(q, b.batch_id)
                    assert len(got) == b.size
                    if k % 50 == 0:
                        assert q.release_batch(b.batch_id, delay=0) == b.size
                        continue
                    if k % 50 == 10:
                        q.extend_batch(b.batch_id, 60)
                    if k == 20:
                        with pytest.raises(_RolledBack), one.transaction() as conn:
                            q.ack_batch(b.batch_id, conn=conn)
                            raise _RolledBack
                    with one.transaction() as conn:  # the results and the ack commit together
                        assert q.ack_batch(b.batch_id, conn=conn) == b.size
                        finished[key] += got
            for key, q in handles.items():
                while b := q.claim_batch(100):
                    assert len(q.leased(b.receipts)) == b.size
                    finished[key] += read(q, b.batch_id)
                    assert q.ack_batch(b.batch_id) == b.size

    try:
        _flush_stats(dbq.db.dsn, dbq.schema, churn)
        prefixes = {"default": f"ring_{rows.settings.queue_id}_r", "g": group._own()}  # type: ignore[attr-defined]
        counts = {
            g: _write_counts(dbq.db.dsn, dbq.schema, p.replace("_", "\\_") + "%") for g, p in prefixes.items()
        }
        ledger = _write_counts(dbq.db.dsn, dbq.schema, "batches")
    finally:
        holder.close()
    for key, got in finished.items():
        assert len(got) == 600 and checksum(got) == checksum(sent), key
    print(f"rows ring's and its group's tables under the hold, batches (ins, upd, del, dead): {counts}")
    for g, prefix in prefixes.items():
        short = {name[len(prefix) :]: c for name, c in counts[g].items()}
        assert short["b"][0] > 50 and short["bs"][0] > 50, g  # the statistics were flushed: claims and states
        assert sum(short[f"r{k}"][0] for k in range(4)) > 50, g  # retry rows: releases, extended leases
        assert {name: c[1:3] for name, c in short.items() if c[1:3] != (0, 0)} == {}, g  # no update or delete
        # the rolled-back ack's two rows (its done row's segment may have been emptied since, forgetting it)
        dead = {name: c[3] for name, c in short.items() if c[3]}
        assert dead.pop("bs") == 1 and sum(dead.values()) <= 1 and all(n.startswith("d") for n in dead), short
    assert "q0" not in counts["g"]  # the group reads the ring's segments: it has none of its own
    assert rows.stats().extra["segment_generations"] != [0, 1, 2, 3]  # the segments rotated
    assert ledger["batches"][1] > 0, ledger


@contextlib.contextmanager
def segment_reads_wait(dbq: DbQueue, q: Queue, key: int) -> Iterator[tuple[psycopg.Connection[Any], str]]:
    """A hook of the test's own, in the middle of a statement of the ring's: a login role granted pop on
    ring ``q``, whose every read of the ring's first segment table waits (a row-level security policy,
    under which a role that is not the owner reads) while the advisory lock ``key`` is held. Yields an
    autocommit connection of the owner's (to hold the lock) and the role; undoes it all on exit."""
    role, hook = f"dbq_role_{uuid.uuid4().hex[:8]}", f"dbq_hook_{uuid.uuid4().hex[:8]}"
    table = f'"{dbq.schema}".ring_{q.settings.queue_id}_rq0'
    admin = psycopg.connect(dbq.db.dsn, autocommit=True)
    try:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
        dbq.grant(role, q.name, ["pop"])
        admin.execute(f'CREATE SCHEMA "{hook}"')
        admin.execute(f'GRANT USAGE ON SCHEMA "{hook}" TO "{role}"')
        admin.execute(
            f'CREATE FUNCTION "{hook}".wait() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN '
            f"PERFORM pg_advisory_lock_shared({key}); PERFORM pg_advisory_unlock_shared({key}); "
            "RETURN true; END $$"
        )
        admin.execute(f'CREATE POLICY hook ON {table} FOR SELECT USING ("{hook}".wait())')
        admin.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        yield admin, role
    finally:
        admin.execute("SELECT pg_advisory_unlock_all()")
        admin.execute(f"DROP POLICY IF EXISTS hook ON {table}")
        admin.execute(f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY")
        admin.execute(f'DROP SCHEMA IF EXISTS "{hook}" CASCADE')
        admin.execute(f'DROP OWNED BY "{role}"')
        admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        admin.close()


def test_a_pop_of_one_whose_lane_moved_between_its_read_and_its_lock_takes_the_lanes_next_message(
    dbq: DbQueue,
) -> None:
    """The pop of one (``rtake1``) reads the lanes' positions, then try-locks the lane it picked, in one
    statement: another pop may take that lane's message and commit in between, so the statement after
    the lock checks that the lane's position is still the one read, and takes nothing otherwise (the
    general pop then takes the lane's next message). Made to happen here by :func:`segment_reads_wait`:
    a role's pop reads the position, then waits (reading the lane's row) while the owner's pop takes the
    lane's message, then locks the lane. Each message is taken once, counted and checksummed."""
    q = rows_ring(dbq, "raced", capacity=64, lanes=1)
    sent = [{"i": i} for i in range(3)]
    ids = [q.push_batch([p])[0] for p in sent]  # a row each, all in the one lane
    key = 4242_4242
    got: dict[str, list[Any]] = {}
    errors: list[BaseException] = []
    with segment_reads_wait(dbq, q, key) as (admin, role):
        admin.execute("SELECT pg_advisory_lock(%s)", (key,))  # the role's reads of the segment wait
        with DbQueue(psycopg.conninfo.make_conninfo(dbq.db.dsn, user=role), schema=dbq.schema) as theirs:
            mine = theirs.queue("raced")

            def pop_as_role() -> None:
                try:
                    got["role"] = mine.pop(1)
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            t = threading.Thread(target=pop_as_role)
            t.start()
            deadline = time.monotonic() + 30
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE usename = %s AND wait_event = 'advisory'"
            while admin.execute(waiting, (role,)).fetchone() != (1,):
                assert time.monotonic() < deadline and t.is_alive(), errors
                time.sleep(0.01)
            got["owner"] = q.pop(1)  # the owner's pop takes the lane's message meanwhile
            admin.execute("SELECT pg_advisory_unlock(%s)", (key,))
            t.join(30)
            assert not errors and not t.is_alive(), errors
    assert [m.id for m in got["owner"]] == ids[:1]
    assert [m.id for m in got["role"]] == ids[1:2]  # the lane's next message, not the owner's again
    rest = drain(q)
    assert [m.id for m in rest] == ids[2:]
    taken = got["owner"] + got["role"] + rest
    assert checksum(m.payload for m in taken) == checksum(sent) and q.stats().ready == 0
