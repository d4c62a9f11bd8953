"""The ring's rows layout (``create_queue(design="ring", layout="rows")``): what it does, what it refuses
by name, its rotation under concurrent pushers and pops, and its size under a held xmin horizon.

The conformance suite (``test_conformance.py``) runs against it too, for what it supports."""

from __future__ import annotations

import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue.engine import ConfigurationError, NotSupportedError, QueueFullError, QueueNotFoundError
from tests.helpers import checksum, held_horizon

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Queue

pytestmark = pytest.mark.integration


def rows_ring(dbq: DbQueue, name: str = "r", **settings: Any) -> Queue:
    return dbq.create_queue(name, design="ring", layout="rows", **settings)


def drain(q: Queue, n: int = 100) -> list[Any]:
    out = []
    while batch := q.pop(n):
        out.extend(batch)
    return out


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
    q = rows_ring(dbq, capacity=64, lanes=4)
    q.push_batch([1, 2])
    for call in (
        lambda: q.pop(1, semantics="at-least-once"),
        lambda: q.add_group("g"),
        lambda: q.pop(1, group="g"),
        lambda: q.claim_batch(10),
        lambda: q.ack([]),
    ):
        with pytest.raises(NotSupportedError, match="rows layout"):
            call()
    assert [m.payload for m in q.pop(10)] == [1, 2]  # nothing taken by the refusals
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
    slots = dbq.create_queue("s", design="ring", capacity=160, lanes=2)
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
