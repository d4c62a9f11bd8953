"""The table design's floor on a real PostgreSQL: a time at or below the process-at time of every ready,
delayed and leased message of a queue (functions.sql's table_floor), raised by the partition recycling
(table_raise_floors, under the queue's push lock taken exclusively) and kept by every writer of a ready
message, so that the claims start their walk of the ready index at it and pass no entry of a message
popped below it. Every message that goes in comes out (counted and checksummed)."""

from __future__ import annotations

import datetime as dt
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.errors import ForeignObjectsError, LeaseExpiredError, QueueNotFoundError
from tests.helpers import checksum, held_horizon
from tests.integration.test_conformance import drain
from tests.integration.test_plans import scans

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_recycling_pass(dbq: DbQueue) -> Iterator[None]:
    """The tests raise the floors themselves, at the moments they choose: no pass of the DbQueue's own
    recycling (which raises them too) runs meanwhile."""
    assert dbq.recycler is not None
    with dbq.recycler.suspended():
        yield


def raise_floors(dbq: DbQueue) -> int:
    """One raise of every queue's floor, as a recycling pass runs it."""
    row = dbq.db.fetchone("table_raise_floors")  # type: ignore[attr-defined]
    assert row is not None
    return int(row[0])


def floor_of(pg_dsn: str, schema: str, queue_id: int) -> dt.datetime | None:
    """The queue's floor, None while it has none ('-infinity')."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        row = c.execute(
            sql.SQL("SELECT nullif({}.table_floor(%s), '-infinity')").format(sql.Identifier(schema)),
            [queue_id],
        ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def below_floor(pg_dsn: str, schema: str, queue_id: int) -> int:
    """Ready or delayed rows of the queue below its floor, the floor read before the rows' snapshot
    (a floor read after it may have been raised past rows popped since)."""
    floor = floor_of(pg_dsn, schema, queue_id) or dt.datetime(1, 1, 1, tzinfo=dt.UTC)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        row = c.execute(
            sql.SQL(
                "SELECT count(*) FROM {}.meta WHERE queue_id = %s AND state = 0 AND process_at < %s"
            ).format(sql.Identifier(schema)),
            [queue_id, floor],
        ).fetchone()
    assert row is not None
    return int(row[0])


def old_transaction(pg_dsn: str) -> psycopg.Connection[Any]:
    """A READ COMMITTED transaction whose now() is fixed now, left open: what it writes later carries
    a time older than anything committed meanwhile."""
    conn = psycopg.connect(pg_dsn)
    conn.execute("SELECT now()")
    time.sleep(0.02)
    return conn


def test_the_floor_rises_to_the_oldest_waiting_or_leased_message_and_never_past_now(
    dbq: DbQueue, pg_dsn: str
) -> None:
    """A new queue has no floor; a raise sets it to the process-at time of its oldest ready, delayed or
    leased message, or to the raise's time when it has none; a
    leased message holds the floor at its time until it is acked; it never goes down."""
    q = dbq.create_queue("floor_rises", archive=False)
    qid = q.settings.queue_id
    assert floor_of(pg_dsn, dbq.schema, qid) is None  # its sequence is made with the queue, unset
    sent = [{"i": i} for i in range(30)]
    for p in sent[:10]:
        q.push(p)
    [held] = q.pop(1, semantics="at-least-once", visibility_timeout=60)
    for p in sent[10:20]:
        q.push(p, priority=5)
    q.push(sent[20], delay=3600)
    assert raise_floors(dbq) == 1
    floor = floor_of(pg_dsn, dbq.schema, qid)
    assert floor is not None
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        row = c.execute(
            sql.SQL("SELECT min(process_at) FROM {}.meta WHERE queue_id = %s AND state IN (0, 1)").format(
                sql.Identifier(dbq.schema)
            ),
            [qid],
        ).fetchone()
    assert row is not None and floor == row[0], (floor, row)
    got = [m.payload for m in q.pop(100)]  # nine of priority 0 after ten of priority 5
    assert got == sent[10:20] + sent[1:10], got
    raise_floors(dbq)
    assert floor_of(pg_dsn, dbq.schema, qid) == floor  # the lease holds it
    q.ack([held])
    raise_floors(dbq)
    risen = floor_of(pg_dsn, dbq.schema, qid)
    assert risen is not None and floor < risen <= dt.datetime.now(dt.UTC), (
        floor,
        risen,
    )  # only the delayed one is left
    for p in sent[21:]:
        q.push(p)
    raise_floors(dbq)
    assert (floor_of(pg_dsn, dbq.schema, qid) or risen) >= risen
    got += [m.payload for m in q.pop(100)]
    assert len(got) == 28 and checksum([*got, held.payload]) == checksum(sent[:20] + sent[21:])
    assert below_floor(pg_dsn, dbq.schema, qid) == 0


def test_every_writer_of_a_ready_message_keeps_the_floor_from_a_transaction_older_than_the_raise(  # noqa: PLR0915
    dbq: DbQueue, pg_dsn: str
) -> None:
    """Each writer of a ready message runs in a transaction that began before the messages now waiting
    were pushed and the floor was raised to them, so its own time is below the floor: a push and a push
    with options take the floor instead, a requeue of a failed message too, a nack keeps the message's
    own time (a leased message's time holds the floor), a reclaimed lease keeps its time. After each,
    no ready row is below the floor, and every message comes out once, in priority and FIFO order."""
    q = dbq.create_queue("floor_writers", archive=False, max_attempts=3, retry_backoff=0.0)
    qid = q.settings.queue_id
    raise_floors(dbq)
    sent: list[Any] = []
    got: list[Any] = []

    def newer(tag: str) -> None:
        """Take every waiting message out, push one now and raise the floor to it: the floor is then
        later than the old transaction's time."""
        got.extend(m.payload for m in drain(q))
        sent.append({"newer": tag})
        q.push(sent[-1])
        raise_floors(dbq)

    def check(tag: str) -> None:
        assert below_floor(pg_dsn, dbq.schema, qid) == 0, tag

    # a message that fails (three deliveries), for the requeue below
    sent.append({"failed": 1})
    q.push(sent[-1])
    for _ in range(3):
        q.nack(q.pop(1, semantics="at-least-once"), delay=0)
    assert [f.payload for f in q.list_failed()] == [{"failed": 1}]
    # push, push with a deduplication key (table_push_with), delayed push
    for tag, options in (
        ("push", {}),
        ("push_with", {"dedup_key": "k1"}),
        ("push_delayed", {"delay": 0.001}),
    ):
        old = old_transaction(pg_dsn)
        newer(tag)
        sent.append({"old": tag})
        q.push(sent[-1], conn=old, **options)
        old.commit()
        old.close()
        check(tag)
    # requeue_failed in an old transaction
    old = old_transaction(pg_dsn)
    newer("requeue")
    requeued = dbq.db.fetchall("requeue_failed", {"queue_id": qid, "all": True, "ids": []}, old)  # type: ignore[attr-defined]
    old.commit()
    old.close()
    assert len(requeued) == 1
    check("requeue")
    # nack: the lease is taken after the old transaction began, the nack made in it
    old = old_transaction(pg_dsn)
    newer("nack")
    [m] = q.pop(1, semantics="at-least-once")
    raise_floors(dbq)
    q.nack([m], delay=0, conn=old)
    old.commit()
    old.close()
    check("nack")
    # a reclaimed lease keeps its time: a raise while it is leased does not pass it
    got.extend(m.payload for m in drain(q))
    sent.append({"leased": 1})
    q.push(sent[-1])
    [m] = q.pop(1, semantics="at-least-once", visibility_timeout=0.2)
    time.sleep(0.3)
    sent.append({"newer": "reclaim"})
    q.push(sent[-1])
    raise_floors(dbq)
    assert q.reclaim_expired() == 1
    check("reclaim")
    got += [m.payload for m in drain(q)]
    assert [g for g in got if "leased" in g or "newer" in g][-2:] == [{"leased": 1}, {"newer": "reclaim"}]
    assert len(got) == len(sent) and checksum(got) == checksum(sent), (got, sent)


def test_pushes_nacks_and_reclaims_beside_raises_lose_nothing_and_no_claim_skips_a_message(  # noqa: PLR0915
    dbq: DbQueue, pg_dsn: str
) -> None:
    """Producers (some in transactions older than the raises, some with priorities and delays),
    consumers that lease, ack, nack and let leases expire, and a loop that raises the floor and reclaims
    expired leases, all at once. Meanwhile no ready row is ever below the floor; at the end every
    message was acked exactly once, counted and checksummed."""
    q = dbq.create_queue("floor_race", archive=True, max_attempts=1000, retry_backoff=0.0)
    qid = q.settings.queue_id
    raise_floors(dbq)
    producers, per_producer, consumers = 3, 400, 3
    stop = threading.Event()
    pushed: list[Any] = []
    acked: list[Any] = []
    errors: list[BaseException] = []
    below: list[int] = []
    lock = threading.Lock()

    def produce(p: int) -> None:
        rnd = random.Random(p)
        try:
            for k in range(0, per_producer, 10):
                batch = [{"p": p, "k": k + i} for i in range(10)]
                prio = rnd.choice((0, 0, 1, -1))
                delay = rnd.choice((0.0, 0.0, 0.0, 0.05))
                if rnd.random() < 0.3:  # a transaction that began before a raise
                    with psycopg.connect(pg_dsn) as old:
                        old.execute("SELECT now()")
                        time.sleep(rnd.random() * 0.02)
                        q.push_batch(batch, priority=prio, delay=delay, conn=old)
                        old.commit()
                else:
                    q.push_batch(batch, priority=prio, delay=delay)
                with lock:
                    pushed.extend(batch)
        except BaseException as exc:
            errors.append(exc)

    def consume(c: int) -> None:
        rnd = random.Random(100 + c)
        try:
            while True:
                ms = q.pop(5, semantics="at-least-once", visibility_timeout=0.2)
                if not ms:
                    if stop.is_set():
                        return
                    time.sleep(0.01)
                    continue
                r = rnd.random()
                if r < 0.15:
                    continue  # let the lease expire: the reclaim returns them
                try:
                    if r < 0.35:
                        q.nack(ms, delay=rnd.choice((0.0, 0.02)))
                    else:
                        q.ack(ms)
                        with lock:
                            acked.extend(m.payload for m in ms)
                except LeaseExpiredError:  # a lease lost to the reclaim: the message comes again
                    pass
        except BaseException as exc:
            errors.append(exc)

    def upkeep() -> None:
        try:
            while not stop.is_set():
                raise_floors(dbq)
                q.reclaim_expired()
                below.append(below_floor(pg_dsn, dbq.schema, qid))
                time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    workers = [threading.Thread(target=consume, args=(c,)) for c in range(consumers)]
    keeper = threading.Thread(target=upkeep)
    for t in [*threads, *workers, keeper]:
        t.start()
    for t in threads:
        t.join(120)
    deadline = time.monotonic() + 120
    while len(acked) < producers * per_producer and time.monotonic() < deadline and not errors:
        time.sleep(0.05)
    stop.set()
    for t in [*workers, keeper]:
        t.join(60)
    assert not errors, errors
    assert below and max(below) == 0, below
    assert len(pushed) == producers * per_producer
    assert len(acked) == len(pushed), (len(acked), len(pushed))
    assert checksum(acked) == checksum(pushed)
    assert drain(q) == []


def test_once_the_floor_is_raised_a_claim_reads_no_entry_of_the_messages_popped_below_it(
    dbq: DbQueue, pg_dsn: str
) -> None:
    """Under a held xmin horizon (no entry of a popped message can be removed or marked dead), a pop of
    ten after 10,000 pops reads about every entry of the popped messages before the raise, and after it
    reads at most the entries of the messages that share the floor's time (one push of 100) and its
    own; so do a peek and a count of ready messages."""
    q = dbq.create_queue("floor_bound", archive=False)
    db: Any = dbq.db
    qid = q.settings.queue_id
    payloads = [{"i": i} for i in range(12_000)]
    raise_floors(dbq)
    hold = held_horizon(pg_dsn)
    out: list[Any] = []
    try:
        for k in range(0, len(payloads), 100):
            q.push_batch(payloads[k : k + 100])
        while len(out) < 10_000:
            out += q.pop_payloads(1000)
        reads = {}
        with dbq.db.connection() as c:  # type: ignore[attr-defined]
            for when in ("before", "after"):
                if when == "after":
                    raise_floors(dbq)
                got: list[Any] = []
                read = scans(c, dbq.schema, lambda got=got: got.extend(q.pop_payloads(10, conn=c)))
                out += got
                peeked = scans(
                    c, dbq.schema, lambda: db.fetchall("peek", {"queue_id": qid, "n": 1, "opts": False}, c)
                )
                counted = scans(
                    c,
                    dbq.schema,
                    lambda: db.fetchone(
                        "count_ready",
                        {"queue_id": qid, "min_priority": -32768, "cap": 5, "max_attempts": 5, "opts": False},
                        c,
                    ),
                )
                reads[when] = (
                    read["meta_ready_idx"][1],
                    peeked["meta_ready_idx"][1],
                    counted["meta_ready_idx"][1],
                )
    finally:
        hold.close()
    assert min(reads["before"]) >= 10_000, reads
    assert max(reads["after"]) <= 250, reads
    out += [m.payload for m in drain(q)]
    assert len(out) == len(payloads) and checksum(out) == checksum(payloads)


def test_a_raise_drops_a_dropped_queues_floor_and_no_sequence_of_someone_elses(
    dbq: DbQueue, pg_dsn: str
) -> None:
    """A raise drops the floor sequence of a queue dropped since, and leaves a sequence of the same kind
    of name that someone else made in the schema (not the engine's: not owned by queues.queue_id)."""
    q = dbq.create_queue("floor_dropped", archive=False)
    mine = f"table_floor_{q.settings.queue_id}"
    theirs = "table_floor_999999"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("CREATE SEQUENCE {}.{}").format(sql.Identifier(dbq.schema), sql.Identifier(theirs)))
    assert dbq.drop_queue("floor_dropped") is True
    raise_floors(dbq)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        left = {
            r[0]
            for r in c.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname IN (%s, %s)",
                [dbq.schema, mine, theirs],
            )
        }
        c.execute(sql.SQL("DROP SEQUENCE {}.{}").format(sql.Identifier(dbq.schema), sql.Identifier(theirs)))
    assert left == {theirs}


@pytest.mark.parametrize("kind", ["SEQUENCE", "TABLE"])
def test_a_queue_is_not_created_over_a_relation_of_someone_elses_named_like_its_floor(
    dbq: DbQueue, pg_dsn: str, kind: str
) -> None:
    """create_queue refuses, with ForeignObjectsError and no queue made, when the schema holds a relation
    of someone else's named like the new queue's floor sequence (table_floor_<queue_id>, not owned by
    queues.queue_id): the queue's pushes and claims would read it as the floor, and a raise would set it.
    The relation is left as it was; once it is gone, the queue is created with a floor of its own."""
    schema = sql.Identifier(dbq.schema)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT coalesce(s.last_value + s.increment_by, s.start_value) FROM pg_sequences s "
            "WHERE s.schemaname = %s AND s.sequencename = "
            "split_part(pg_get_serial_sequence(%s, 'queue_id'), '.', 2)",
            [dbq.schema, f'"{dbq.schema}".queues'],
        ).fetchone()
        assert row is not None and row[0] is not None
        theirs = f"table_floor_{row[0]}"  # the name the next queue's floor would take
        if kind == "SEQUENCE":
            c.execute(sql.SQL("CREATE SEQUENCE {}.{}").format(schema, sql.Identifier(theirs)))
            c.execute(sql.SQL("SELECT setval({}, 42)").format(sql.Literal(f'"{dbq.schema}".{theirs}')))
        else:
            c.execute(sql.SQL("CREATE TABLE {}.{} (x integer)").format(schema, sql.Identifier(theirs)))
            c.execute(sql.SQL("INSERT INTO {}.{} VALUES (42)").format(schema, sql.Identifier(theirs)))
    with pytest.raises(ForeignObjectsError, match=theirs):
        dbq.create_queue("floor_foreign")
    assert "floor_foreign" not in {s.name for s in dbq.list_queues()}
    with pytest.raises(QueueNotFoundError):
        dbq.queue("floor_foreign")
    read = "SELECT last_value FROM {}.{}" if kind == "SEQUENCE" else "SELECT x FROM {}.{}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        assert c.execute(sql.SQL(read).format(schema, sql.Identifier(theirs))).fetchall() == [(42,)]
        c.execute(sql.SQL("DROP {} {}.{}").format(sql.SQL(kind), schema, sql.Identifier(theirs)))
    q = dbq.create_queue("floor_foreign", archive=False)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        owned = c.execute(
            "SELECT count(*) FROM pg_depend d WHERE d.objid = to_regclass(%s) AND d.deptype = 'a' "
            "AND d.refobjid = to_regclass(%s)",
            [f'"{dbq.schema}".table_floor_{q.settings.queue_id}', f'"{dbq.schema}".queues'],
        ).fetchone()
    assert owned == (1,)
    sent = [{"n": i} for i in range(10)]
    q.push_batch(sent)
    got = [m.payload for m in drain(q)]
    assert len(got) == len(sent) and checksum(got) == checksum(sent)
    assert dbq.drop_queue("floor_foreign") is True
