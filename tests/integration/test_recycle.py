"""The table design's partition recycling on a real PostgreSQL: meta, data and done are partitioned by
generation (schema.sql), and Maintenance.recycle empties with TRUNCATE the partitions that hold no row,
also while a REPEATABLE READ transaction holds the xmin horizon (VACUUM can then remove nothing), so
that after the hold the tables come back to their size before it without a rewrite. Messages that
would keep an old partition from emptying (delayed, retrying, failed) move into the generation pushes
write now under their ids; a leased one keeps its partition until it is acked. Every message comes out
exactly once (counted and checksummed)."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import DbQueue, MaintenanceConfig
from airflow_dbqueue.engine.maintenance.recycler import recycle_partitions
from tests.helpers import (
    checksum,
    engine_sessions,
    held_horizon,
    notified_so_far,
    push_holding_the_waiters_lock,
)

pytestmark = pytest.mark.integration

GENERATION_IDS = 16_384
"""Ids a generation (schema.sql: gen = (id >> 14) & 7)."""


def table_bytes(pg_dsn: str, schema: str) -> int:
    """meta, data and done with their indexes, summed over their partitions."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT sum(pg_total_relation_size(p.relid)) FROM unnest(ARRAY['meta', 'data', 'done']) AS t "
            "CROSS JOIN pg_partition_tree(format('%%I.%%I', %s::text, t)::regclass) AS p",
            [schema],
        ).fetchone()
    return int(row[0]) if row else 0


def generations(pg_dsn: str, schema: str, ids: list[int]) -> dict[int, int]:
    """The generation (partition) each message of ``ids`` is in now."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        rows = c.execute(
            sql.SQL("SELECT id, gen FROM {}.meta WHERE id = ANY (%s)").format(sql.Identifier(schema)), [ids]
        ).fetchall()
    return {int(i): int(g) for i, g in rows}


def jump_ids(pg_dsn: str, schema: str, generations_ahead: int) -> None:
    """Move the message id sequence on by whole generations (ids have gaps anyway: a rolled-back push
    leaves one), so that pushes write a later generation without pushing that many messages."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            sql.SQL("SELECT setval(%s, (SELECT last_value FROM {}.message_id_seq) + %s)").format(
                sql.Identifier(schema)
            ),
            [f"{schema}.message_id_seq", generations_ahead * GENERATION_IDS],
        )


def test_after_a_held_horizon_the_tables_come_back_to_their_size_and_every_message_came_once(
    dbq: DbQueue, pg_dsn: str
) -> None:
    """Messages flow through four generations while a REPEATABLE READ transaction holds the horizon,
    with recycling between rounds: it empties the generations consumed meanwhile although the horizon
    is held. After the release and one maintain() the tables are within 1.5x of their size before the
    hold, and every message came out exactly once."""
    q = dbq.create_queue("flow", archive=False)
    sent: list[Any] = []
    got: list[Any] = []

    def flow(n: int, start: int) -> None:
        for k in range(start, start + n, 500):
            batch = [{"k": i, "pad": "x" * (i % 300)} for i in range(k, min(k + 500, start + n))]
            q.push_batch(batch)
            sent.extend(batch)
            got.extend(m.payload for m in q.pop(500))

    flow(2_000, 0)
    m = dbq.maintenance()
    m.vacuum()
    before = table_bytes(pg_dsn, dbq.schema)
    conn = held_horizon(pg_dsn, application_name="held-horizon", xid=True)
    emptied_in_hold: list[str] = []
    try:
        for r in range(4):
            flow(GENERATION_IDS, 2_000 + r * GENERATION_IDS)
            emptied_in_hold += m.recycle(recycle_min_bytes=0)["emptied"]
        in_hold = table_bytes(pg_dsn, dbq.schema)
        still_open = conn.execute("SELECT txid_current_if_assigned() IS NOT NULL").fetchone()
    finally:
        conn.close()
    assert still_open == (True,)
    assert any(p.startswith("meta_") for p in emptied_in_hold), emptied_in_hold
    report = dbq.maintain(MaintenanceConfig(archive_after_s=0, recycle_min_bytes=0))
    assert report["skipped"] is None
    after = table_bytes(pg_dsn, dbq.schema)
    got.extend(m.payload for m in q.pop(1_000))
    assert q.pop(1) == []
    assert len(got) == len(sent) == 2_000 + 4 * GENERATION_IDS
    assert checksum(got) == checksum(sent)
    assert after <= 1.5 * before, (before, in_hold, after)


def test_stragglers_move_forward_and_do_not_pin_their_partition(dbq: DbQueue, pg_dsn: str) -> None:
    """A delayed message, a retrying one (nacked with a backoff) and a failed one in generation 0 move
    into the generation pushes write now once that is two generations on, under their ids, and meta_0
    is emptied; a leased message keeps meta_1 until it is acked. Each then comes out once, with its
    payload; the failed one is requeued first."""
    q = dbq.create_queue("stragglers", max_attempts=2, archive=False)
    [delayed] = q.push_batch([{"s": "delayed"}], delay=3600)
    retrying, failing = q.push_batch([{"s": "retrying"}, {"s": "failing"}])
    [first] = q.pop(1, semantics="at-least-once")
    [second] = q.pop(1, semantics="at-least-once")
    assert (first.id, second.id) == (retrying, failing)
    assert q.nack([first], delay=3600) == 1  # retrying: ready again in an hour
    assert q.nack([second], delay=0) == 1
    [again] = q.pop(1, semantics="at-least-once")
    assert q.nack([again], delay=0) == 1  # its second delivery of two: failed
    ids = [delayed, retrying, failing]
    assert generations(pg_dsn, dbq.schema, ids) == dict.fromkeys(ids, 0)
    jump_ids(pg_dsn, dbq.schema, 1)
    [leased_id] = q.push_batch([{"s": "leased"}])  # generation 1
    [leased] = q.pop(1, semantics="at-least-once", visibility_timeout=600)
    assert leased.id == leased_id
    jump_ids(pg_dsn, dbq.schema, 2)
    q.push_batch([{"s": "now"}])  # generation 3: the one pushes write now
    report = dbq.maintenance().recycle(recycle_min_bytes=0)
    assert report["moved"] == 3, report
    assert generations(pg_dsn, dbq.schema, ids) == dict.fromkeys(ids, 3)
    assert "meta_0" in report["emptied"] and "meta_1" not in report["emptied"], report
    assert generations(pg_dsn, dbq.schema, [leased_id]) == {leased_id: 1}
    assert q.ack([leased]) == 1  # its receipt still holds
    assert "meta_1" in dbq.maintenance().recycle(recycle_min_bytes=0)["emptied"]
    assert [f.id for f in q.list_failed()] == [failing]
    assert q.requeue_failed() == 1
    out = q.pop(10)
    assert sorted(m.payload["s"] for m in out) == ["failing", "now"]
    assert next(m.id for m in out if m.payload["s"] == "failing") == failing
    s = q.stats()
    assert (s.ready, s.delayed, s.in_flight, s.failed) == (0, 2, 0, 0)


def test_a_reader_of_a_partition_keeps_it_and_one_that_had_not_read_it_sees_it_empty(
    dbq: DbQueue, pg_dsn: str
) -> None:
    """TRUNCATE is not MVCC-safe, so recycling empties only a partition that holds no row and that no
    open transaction has read: a REPEATABLE READ transaction that read meta holds a lock on each of its
    partitions until it ends, and the partition's emptying gives up within its lock timeout (the next
    run empties it). A REPEATABLE READ consumer whose snapshot is older than the TRUNCATE but that had
    not read meta sees the emptied partition empty: it misses only messages finished before, and pops
    the others exactly once."""
    q = dbq.create_queue("readers", archive=False)
    first = q.push_batch([{"n": i} for i in range(100)])  # generation 0
    assert len(q.pop(100)) == 100
    jump_ids(pg_dsn, dbq.schema, 2)
    later = q.push_batch([{"n": i} for i in range(100, 150)])  # generation 2
    reader = psycopg.connect(pg_dsn)
    reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    consumer = psycopg.connect(pg_dsn)
    consumer.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        seen = reader.execute(sql.SQL("SELECT count(*) FROM {}.meta").format(sql.Identifier(dbq.schema)))
        assert seen.fetchone() == (50,)
        consumer.execute("SELECT txid_current(), count(*) FROM pg_class")  # its snapshot, not meta
        blocked = dbq.maintenance().recycle(recycle_min_bytes=0, recycle_lock_timeout=0.05)
        assert "meta_0" in blocked["lock_not_granted"] and "meta_0" not in blocked["emptied"], blocked
        reader.rollback()
        emptied = dbq.maintenance().recycle(recycle_min_bytes=0)
        assert "meta_0" in emptied["emptied"], emptied
        popped = q.pop(200, conn=consumer)
        consumer.commit()
    finally:
        reader.close()
        consumer.close()
    assert sorted(m.id for m in popped) == later and first[0] not in {m.id for m in popped}
    assert checksum(m.payload for m in popped) == checksum({"n": i} for i in range(100, 150))
    assert q.pop(1) == []


def partition_bytes(pg_dsn: str, schema: str, table: str) -> dict[int, int]:
    """The size of each partition of ``table`` (heap and indexes), by generation."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT g, pg_total_relation_size(format('%%I.%%I', %s::text, %s || '_' || g)::regclass) "
            "FROM generate_series(0, 7) AS g",
            [schema, table],
        ).fetchall()
    return {int(g): int(b) for g, b in rows}


@pytest.mark.parametrize("auto", [True, False], ids=["recycling", "recycle_interval=None"])
def test_a_dbqueue_recycles_by_itself_while_the_horizon_is_held(
    pg_dsn: str, schema_name: str, auto: bool
) -> None:
    """A DbQueue that pushes and pops a table queue empties the partitions of the generations it
    consumed on its own, about a second after they emptied, while a REPEATABLE READ transaction holds
    the horizon and no maintenance runs; with ``recycle_interval=None`` the same flow leaves them
    holding their dead rows. Every message comes out exactly once either way."""
    with DbQueue(pg_dsn, schema=schema_name, recycle_interval=0.2 if auto else None) as dbq:
        dbq.install()
        assert (dbq.recycler is not None) == auto
        q = dbq.create_queue("self_recycling", archive=False)
        sent: list[Any] = []
        got: list[Any] = []
        conn = held_horizon(pg_dsn, application_name="held-horizon", xid=True)
        try:
            for k in range(0, 50_000, 1_000):  # ids 1 to 50,000: generations 0 to 3
                batch = [{"k": i, "pad": "y" * (i % 200)} for i in range(k, k + 1_000)]
                q.push_batch(batch)
                sent.extend(batch)
                got.extend(m.payload for m in q.pop(1_000))
            q.push_batch([{"k": -1}])  # work after the last generation emptied, which the pass follows
            sent.append({"k": -1})
            got.extend(m.payload for m in q.pop(1))
            time.sleep(1.0)
            sizes = partition_bytes(pg_dsn, schema_name, "meta")
            still_open = conn.execute("SELECT txid_current_if_assigned() IS NOT NULL").fetchone()
        finally:
            conn.close()
        assert still_open == (True,)
        assert q.pop(1) == []
        assert len(got) == len(sent) == 50_001
        assert checksum(got) == checksum(sent)
        consumed = [0, 1, 2]  # every message of these generations is gone
        if auto:
            assert dbq.recycler is not None and dbq.recycler.emptied >= 3, dbq.recycler.emptied
            assert all(sizes[g] < 256 * 1024 for g in consumed), sizes
        else:
            assert all(sizes[g] >= 256 * 1024 for g in consumed), sizes
        dbq.uninstall()


def test_passes_of_several_processes_at_once_never_deadlock(dbq: DbQueue) -> None:
    """Recycling passes running at once (each DbQueue of a deployment runs its own) meet at the
    partitions' locks: the second to come to a partition reports it busy instead of waiting for the
    first with the share lock of its check held, which deadlocked. Messages flow meanwhile and each comes
    out once."""
    q = dbq.create_queue("racing_passes", archive=False)
    errors: list[BaseException] = []
    busy: list[str] = []
    stop = threading.Event()

    def passes() -> None:
        try:
            while not stop.is_set():
                out = recycle_partitions(dbq.db, move_limit=0, min_bytes=0, lock_timeout_s=0.5)
                busy.extend(out["lock_not_granted"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=passes) for _ in range(3)]
    for t in threads:
        t.start()
    sent: list[Any] = []
    got: list[Any] = []
    try:
        for k in range(40):
            batch = [{"k": k, "i": i} for i in range(50)]
            q.push_batch(batch)
            sent.extend(batch)
            got.extend(m.payload for m in q.pop(50))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert busy, "the passes never met at a partition: the test did not race them"
    assert len(got) == len(sent) and checksum(got) == checksum(sent)


def test_a_dbqueue_let_go_without_close_does_not_stay_open_for_its_recycling(
    pg_dsn: str, schema_name: str
) -> None:
    """The recycling thread holds its DbQueue's pool weakly: a DbQueue that pushed and popped (so its
    thread runs) and was let go without close() is collected with its pool, whose sessions end, and
    the thread ends with it (a strong reference kept one session open for the life of the process)."""
    with DbQueue(pg_dsn, schema=schema_name) as admin:
        admin.install()
        admin.create_queue("let_go")
        before = engine_sessions(pg_dsn) - 1  # the admin's own session

        def use() -> threading.Thread | None:
            dbq = DbQueue(pg_dsn, schema=schema_name, recycle_interval=0.1)
            q = dbq.queue("let_go")
            q.push_batch([{"n": 1}, {"n": 2}])
            assert checksum(m.payload for m in q.pop(2)) == checksum([{"n": 1}, {"n": 2}])
            assert dbq.recycler is not None
            return dbq.recycler._thread

        thread = use()
        assert thread is not None
        deadline = time.monotonic() + 10
        while (thread.is_alive() or engine_sessions(pg_dsn) - 1 > before) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.1)
        assert not thread.is_alive()
        assert engine_sessions(pg_dsn) - 1 == before
        admin.uninstall()


def test_uninstall_waits_for_its_own_recycling_pass_and_none_runs_during_the_drop(
    pg_dsn: str, schema_name: str
) -> None:
    """A DbQueue's recycling thread runs passes (TRUNCATE of partitions) whenever it worked; its
    uninstall() drops those partitions, and the two at once deadlocked (a test's teardown failed on it
    behind PgBouncer). A pass and the drop now exclude each other: no pass starts while passes are
    suspended (the drop's block), and uninstall() waits for a pass in progress, here one that a thread
    holds for 0.5 s."""
    dbq = DbQueue(pg_dsn, schema=schema_name, recycle_interval=0.05)
    try:
        dbq.install()
        q = dbq.create_queue("dropped_while_recycling", archive=False)
        sent = [{"i": i} for i in range(200)]
        q.push_batch(sent)
        got = [m.payload for m in q.pop(200)]
        assert len(got) == len(sent) and checksum(got) == checksum(sent)
        recycler = dbq.recycler
        assert recycler is not None
        ran: list[float] = []
        with recycler.suspended():
            t = threading.Thread(
                target=lambda: ran.append(recycler.run_once() is not None and time.monotonic())
            )
            t.start()
            time.sleep(0.2)
            assert ran == [], "a pass ran while passes were suspended"
            left = time.monotonic()
        t.join(timeout=30)
        assert ran and ran[0] >= left

        held = threading.Event()

        def hold_a_pass() -> None:
            with recycler.suspended():  # what a pass in progress holds
                held.set()
                time.sleep(0.5)

        holder = threading.Thread(target=hold_a_pass)
        holder.start()
        held.wait(10)
        started = time.monotonic()
        dbq.uninstall()
        assert time.monotonic() - started >= 0.4, "uninstall() did not wait for the pass in progress"
        holder.join()
    finally:
        dbq.close()


def test_auto_notify_asks_the_generation_pushes_write_in_each_of_the_eight(dbq: DbQueue, pg_dsn: str) -> None:
    """A push with notify="auto" that asks the question (another push holds the queue's waiters' lock:
    here a transaction holds it throughout) asks whether its queue had a ready message in the generation
    pushes write now (read from the id sequence's newest number): the first push of a fresh schema
    (no id taken yet), and a first push into the drained queue in each of the eight generations, notify;
    a second push, whose first message waits in that generation, does not. Every message comes out once
    (counted and checksummed)."""
    q = dbq.create_queue("auto_gens", notify="auto")
    channel = dbq.db.channel(q.settings.queue_id)
    sent: list[Any] = []
    got: list[Any] = []
    seen: list[tuple[int, int, int]] = []
    with (
        psycopg.connect(pg_dsn, autocommit=True) as listener,
        push_holding_the_waiters_lock(pg_dsn, dbq.schema, q.settings.queue_id),
    ):
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

        def notified(payload: dict[str, int]) -> tuple[int, int]:
            [mid] = q.push_batch([payload])
            sent.append(payload)
            return mid, notified_so_far(listener, pg_dsn, channel)

        for g in range(9):
            if g:
                jump_ids(pg_dsn, dbq.schema, 1)
            first, n_first = notified({"g": g, "k": 0})
            _, n_second = notified({"g": g, "k": 1})
            seen.append(((first >> 14) & 7, n_first, n_second))
            got.extend(m.payload for m in q.pop(10))
            assert q.pop(1) == []
    assert sorted(s[0] for s in seen[1:]) == list(range(8))  # every generation asked once at least
    assert [(n1, n2) for _, n1, n2 in seen] == [(1, 0)] * 9, seen
    assert len(got) == len(sent) == 18
    assert checksum(got) == checksum(sent)
