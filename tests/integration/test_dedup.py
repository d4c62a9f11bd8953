"""Deduplication keys on push (table design): a second push of a key within the queue's dedup_window
pushes nothing and returns the first push's id, also when the pushes race in separate transactions and
processes; keys older than the window are taken over by a new push and forgotten by the upkeep.

Every test counts what went in and what came out, and compares checksums of the payloads.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.errors import ConfigurationError, NotSupportedError, TransientDatabaseError
from airflow_dbqueue.engine.queue import MAX_DEDUP_KEY_CHARS
from tests.dialects import run_sql
from tests.helpers import checksum, drained

if TYPE_CHECKING:
    from airflow_dbqueue.engine import Queue

pytestmark = pytest.mark.integration


def drain(q: Queue) -> list[Any]:
    """Every payload the queue hands out (at most once), until it is empty."""
    out: list[Any] = []
    while batch := q.pop(500):
        out += [m.payload for m in batch]
    assert drained(q)
    return out


def dedup_rows(dbq: DbQueue) -> int:
    return int(run_sql(dbq, "SELECT count(*) FROM {schema}.dedup")[0][0])


def test_a_second_push_of_a_key_pushes_nothing_and_returns_the_first_id(dbq: DbQueue) -> None:
    q = dbq.create_queue("d")
    first = q.push({"order": 1}, dedup_key="order-1")
    again = q.push({"order": 1, "retry": True}, dedup_key="order-1")
    other = q.push({"order": 2}, dedup_key="order-2")
    plain = [q.push({"order": 3}), q.push({"order": 3})]  # no key: two messages, as before
    assert again == first and other != first and plain[0] != plain[1]
    assert q.stats().ready == 4
    assert checksum(drain(q)) == checksum([{"order": 1}, {"order": 2}, {"order": 3}, {"order": 3}])
    # consumed since: still the first push's id within the window, and still nothing pushed
    assert q.push({"order": 1, "late": True}, dedup_key="order-1") == first
    assert drain(q) == []


def test_a_batch_maps_repeated_and_known_keys_to_their_first_message(dbq: DbQueue) -> None:
    q = dbq.create_queue("d")
    [a] = q.push_batch([{"k": "a"}], dedup_keys=["a"])
    big = {"k": "b", "pad": "x" * 5000}  # stored in data, not in the meta row
    ids = q.push_batch(
        [{"k": "a", "n": 2}, big, {"k": "c"}, {"k": "b", "n": 2}, {"k": "c", "n": 2}],
        dedup_keys=["a", "b", "c", "b", "c"],
    )
    assert ids[0] == a
    assert ids[1] == ids[3] and ids[2] == ids[4]
    assert len({a, ids[1], ids[2]}) == 3 and ids[1] < ids[2]  # new messages keep the batch's order
    assert q.stats().ready == 3
    popped = q.pop(10)
    assert [m.id for m in popped] == [a, ids[1], ids[2]]
    assert checksum(m.payload for m in popped) == checksum([{"k": "a"}, big, {"k": "c"}])
    assert dedup_rows(dbq) == 3


def test_bad_keys_raise_at_once_and_push_nothing(dbq: DbQueue) -> None:
    q = dbq.create_queue("d")
    bad: list[Any] = [
        ["a"],  # one key for two payloads
        "ab",  # a string, not a sequence of keys
        ["a", ""],
        ["a", 7],
        ["a", None],
        ["a", "x" * (MAX_DEDUP_KEY_CHARS + 1)],
        ["a", "nul\x00"],
    ]
    for keys in bad:
        with pytest.raises(ConfigurationError, match="dedup"):
            q.push_batch([1, 2], dedup_keys=keys)
    with pytest.raises(ConfigurationError, match="dedup key #0"):
        q.push(1, dedup_key="")
    assert q.stats().ready == 0 and dedup_rows(dbq) == 0
    assert q.push_batch([], dedup_keys=[]) == []
    for window in (0, -1, float("nan"), "soon"):
        with pytest.raises(ConfigurationError, match="dedup_window"):
            dbq.create_queue("w", dedup_window=window)  # type: ignore[arg-type]
    assert "w" not in {s.name for s in dbq.list_queues()}


def test_the_window_is_a_setting_of_the_queue(dbq: DbQueue) -> None:
    q = dbq.create_queue("d", dedup_window=42.5)
    assert q.settings.dedup_window_s == 42.5
    assert dbq.create_queue("d", dedup_window=42.5).settings.dedup_window_s == 42.5
    assert dbq.create_queue("e").settings.dedup_window_s == 300.0
    assert {s.name: s.dedup_window_s for s in dbq.list_queues()} == {"d": 42.5, "e": 300.0}
    from airflow_dbqueue.engine.errors import QueueExistsError

    with pytest.raises(QueueExistsError, match="dedup_window_s"):
        dbq.create_queue("d", dedup_window=10)


def test_a_ring_refuses_keys(dbq: DbQueue) -> None:
    r = dbq.create_queue("r", design="ring", capacity=16)
    with pytest.raises(NotSupportedError, match="ring: deduplication keys"):
        r.push("x", dedup_key="k")
    with pytest.raises(NotSupportedError, match="ring: deduplication keys"):
        r.push_batch(["x"], dedup_keys=["k"])
    # a window of its own would be a setting that does nothing: refused, and no ring created
    with pytest.raises(NotSupportedError, match="dedup_window applies to table queues only"):
        dbq.create_queue("r2", design="ring", capacity=16, dedup_window=60)
    rows = dbq.create_queue("rows", design="ring", capacity=16, lanes=2, layout="rows")
    with pytest.raises(NotSupportedError, match="ring: deduplication keys"):
        rows.push_batch(["x"], dedup_keys=["k"])
    with pytest.raises(NotSupportedError, match="dedup_window applies to table queues only"):
        dbq.create_queue("r3", design="ring", capacity=16, lanes=2, layout="rows", dedup_window=60)
    assert rows.stats().ready == 0
    dbq.drop_queue("rows")
    assert r.stats().ready == 0 and {s.name for s in dbq.list_queues()} == {"r"}


def test_the_window_boundary(dbq: DbQueue) -> None:
    """A key pushed within the window (by the server's clock) is a duplicate; at the window's end it is
    taken over by the new push, which gets a new message. The key's time is set on the server, so the
    boundary is exact: the push's now() against pushed_at + window."""
    q = dbq.create_queue("d", dedup_window=60)
    first = q.push("one", dedup_key="k")
    set_age = (
        "UPDATE {schema}.dedup SET pushed_at = now() - make_interval(secs => %(age)s) WHERE dedup_key = 'k'"
    )
    run_sql(dbq, set_age, {"age": 59.9})
    assert q.push("two", dedup_key="k") == first
    with dbq.transaction() as conn:  # one now() for both statements: the key is exactly a window old
        run_sql(dbq, set_age, {"age": 60.0}, conn)
        second = q.push("three", dedup_key="k", conn=conn)
    assert second != first
    assert q.push("four", dedup_key="k") == second
    assert checksum(drain(q)) == checksum(["one", "three"])


def test_a_short_window_passes_and_the_upkeep_forgets_old_keys(dbq: DbQueue) -> None:
    q = dbq.create_queue("d", dedup_window=1.0)
    keys = [f"k{i}" for i in range(50)]
    ids = q.push_batch([f"a{i}" for i in range(50)], dedup_keys=keys)
    assert q.push_batch([f"b{i}" for i in range(50)], dedup_keys=keys) == ids
    assert q.maintain()["keys_forgotten"] == 0
    assert dbq.maintenance().recover()["d"]["keys_forgotten"] == 0
    time.sleep(1.2)
    report = dbq.maintenance().recover()
    assert report["d"]["keys_forgotten"] == 50 and dedup_rows(dbq) == 0
    again = q.push_batch([f"c{i}" for i in range(50)], dedup_keys=keys)
    assert not set(again) & set(ids) and dedup_rows(dbq) == 50
    time.sleep(1.2)
    taken_over = q.push_batch([f"d{i}" for i in range(25)], dedup_keys=keys[:25])  # before any upkeep
    assert not set(taken_over) & set(again)
    assert q.maintain(limit=10)["keys_forgotten"] == 10  # the upkeep's limit bounds one call
    assert q.maintain()["keys_forgotten"] == 15 and dedup_rows(dbq) == 25
    out = drain(q)
    expected = [f"a{i}" for i in range(50)] + [f"c{i}" for i in range(50)] + [f"d{i}" for i in range(25)]
    assert len(out) == len(expected) == 125
    assert checksum(out) == checksum(expected)


def test_a_retry_waits_for_the_first_push_and_gets_its_id(dbq: DbQueue) -> None:
    """A retried push of a key while the first push's transaction is open waits for it: after its
    commit the retry returns its id and pushes nothing; after its rollback the retry pushes."""
    q = dbq.create_queue("d")
    got: list[int] = []

    def retry(payload: str) -> None:
        got.append(q.push(payload, dedup_key="k"))

    with dbq.transaction() as conn:
        first = q.push("first", dedup_key="k", conn=conn)
        t = threading.Thread(target=retry, args=("retry",))
        t.start()
        t.join(0.5)
        assert t.is_alive() and got == []  # waiting for the first push's transaction
    t.join(10)
    assert got == [first]

    class Abort(Exception):
        pass

    got.clear()
    with pytest.raises(Abort), dbq.transaction() as conn:
        lost = q.push("rolled back", dedup_key="r", conn=conn)
        t = threading.Thread(target=retry_key, args=(q, "r", "retry", got))
        t.start()
        t.join(0.5)
        assert t.is_alive() and got == []
        raise Abort
    t.join(10)
    assert len(got) == 1 and got[0] != lost
    popped = q.pop(10)
    assert [(m.id, m.payload) for m in popped] == [(first, "first"), (got[0], "retry")]


def retry_key(q: Queue, key: str, payload: str, got: list[int]) -> None:
    got.append(q.push(payload, dedup_key=key))


KEYS = 400


def test_racing_threads_push_each_key_once(dbq: DbQueue) -> None:
    """Eight threads push the same keys (each in its own order, batches of 20, some with the same key
    twice): every thread gets the same id for a key, and the queue holds one message a key, the payload
    of the push that won."""
    q = dbq.create_queue("d")
    keys = [f"key-{i}" for i in range(KEYS)]
    results: list[dict[str, int]] = []
    errors: list[BaseException] = []

    def producer(t: int) -> None:
        try:
            order = random.Random(t).sample(keys, len(keys))
            mine: dict[str, int] = {}
            for at in range(0, len(order), 20):
                chunk = order[at : at + 20] + order[at : at + 1]  # its first key twice
                ids = q.push_batch([{"key": k, "thread": t} for k in chunk], dedup_keys=chunk)
                for k, i in zip(chunk, ids, strict=True):
                    assert mine.setdefault(k, i) == i
            results.append(mine)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(results) == 8
    agreed = results[0]
    assert all(r == agreed for r in results) and len(set(agreed.values())) == KEYS
    popped = []
    while batch := q.pop(500):
        popped += batch
    assert drained(q) and len(popped) == KEYS
    assert {m.id: m.payload["key"] for m in popped} == {i: k for k, i in agreed.items()}
    assert checksum(m.payload["key"] for m in popped) == checksum(keys)


def _process_producer(dsn: str, schema: str, p: int, out: Any) -> None:
    try:
        keys = [f"key-{i}" for i in range(KEYS)]
        order = random.Random(100 + p).sample(keys, len(keys))
        mine: dict[str, int] = {}
        with DbQueue(dsn, schema=schema, pool_size=2) as dbq:
            q = dbq.queue("d")
            for at in range(0, len(order), 25):
                chunk = order[at : at + 25]
                for attempt in range(2):  # a retried push: the same keys again
                    ids = q.push_batch([{"key": k, "p": p, "a": attempt} for k in chunk], dedup_keys=chunk)
                    for k, i in zip(chunk, ids, strict=True):
                        assert mine.setdefault(k, i) == i
        out.put(("ok", p, mine))
    except BaseException:
        out.put(("error", p, traceback.format_exc()))


def test_racing_processes_push_each_key_once(dbq: DbQueue) -> None:
    q = dbq.create_queue("d")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_process_producer, args=(dbq.db.dsn, dbq.schema, p, out)) for p in range(4)]
    for pr in procs:
        pr.start()
    reports = [out.get(timeout=180) for _ in procs]
    for pr in procs:
        pr.join(30)
    assert [r for r in reports if r[0] != "ok"] == []
    maps = [r[2] for r in reports]
    assert all(m == maps[0] for m in maps) and len(set(maps[0].values())) == KEYS
    popped = []
    while batch := q.pop(500):
        popped += batch
    assert drained(q) and len(popped) == KEYS
    assert {m.id: m.payload["key"] for m in popped} == {i: k for k, i in maps[0].items()}
    assert all(m.payload["a"] == 0 for m in popped)  # a retry never won over its own first push
    assert checksum(m.payload["key"] for m in popped) == checksum(f"key-{i}" for i in range(KEYS))


def test_a_dropped_queue_forgets_its_keys(dbq: DbQueue) -> None:
    q = dbq.create_queue("d")
    q.push_batch([1, 2, 3], dedup_keys=["a", "b", "c"])
    dbq.create_queue("e").push(4, dedup_key="a")
    assert dedup_rows(dbq) == 4
    dbq.drop_queue("d")
    assert dedup_rows(dbq) == 1
    q = dbq.create_queue("d")
    assert q.push_batch([5, 6], dedup_keys=["a", "b"]) != []
    assert checksum(drain(q)) == checksum([5, 6])


def test_a_repeatable_read_push_of_a_key_committed_since_its_snapshot_is_run_again(
    dbq: DbQueue, pg_dsn: str
) -> None:
    """At REPEATABLE READ a key that another push committed after the caller's snapshot raises a
    serialization failure (TransientDatabaseError); run again, the transaction gets the first id."""
    q = dbq.create_queue("d")
    with psycopg.connect(pg_dsn) as caller:
        caller.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        caller.execute("SELECT 1")  # the transaction's snapshot is taken here
        first = q.push("first", dedup_key="k")
        with pytest.raises(TransientDatabaseError, match="serializ"):
            q.push("second", dedup_key="k", conn=caller)
        caller.rollback()
        assert q.push("second", dedup_key="k", conn=caller) == first
        caller.commit()
    assert checksum(drain(q)) == checksum(["first"])
