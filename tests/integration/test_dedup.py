"""Deduplication keys on push (table design, and rings of the rows layout: each test that fits both runs
on both, ``design``): a second push of a key within the queue's dedup_window pushes nothing and returns
the first push's id, also when the pushes race in separate transactions and processes; keys older than
the window are taken over by a new push and forgotten by the upkeep.

Every test counts what went in and what came out, and compares checksums of the payloads.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    NotSupportedError,
    QueueFullError,
    TransientDatabaseError,
)
from airflow_dbqueue.engine.models import Design
from airflow_dbqueue.engine.queue import MAX_DEDUP_KEY_CHARS
from tests.dialects import run_sql
from tests.helpers import checksum, child_processes, drained

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


@pytest.fixture(params=["table", "rows"])
def design(request: pytest.FixtureRequest) -> str:
    """The design a test's queues are made of: the table design, or a ring of the rows layout."""
    return str(request.param)


def make(dbq: DbQueue, name: str, design: str, **settings: Any) -> Queue:
    """Create queue ``name`` of ``design``; a ring of the rows layout large enough for every test here
    (1,024 pushes); a payload up to 4,000 bytes."""
    if design == "rows":
        settings = {
            "design": "ring",
            "layout": "rows",
            "capacity": 1024,
            "lanes": 4,
            "max_payload_bytes": 4000,
            **settings,
        }
    return dbq.create_queue(name, **settings)


def keys_table(q: Queue) -> str:
    """The table that holds ``q``'s deduplication keys: the schema's, or the ring's own."""
    if q.settings.design is Design.TABLE:
        return "{schema}.dedup"
    return f"{{schema}}.ring_{q.settings.queue_id}_rkeys"


def dedup_rows(dbq: DbQueue, q: Queue | None = None) -> int:
    """The deduplication keys the schema holds (with ``q``: those of ``q``'s design's table)."""
    table = "{schema}.dedup" if q is None else keys_table(q)
    return int(run_sql(dbq, "SELECT count(*) FROM " + table)[0][0])


def rows_issued(dbq: DbQueue, q: Queue) -> int | None:
    """The row numbers a ring of the rows layout has issued (None for the table design)."""
    if q.settings.design is Design.TABLE:
        return None
    seq = f"{{schema}}.ring_{q.settings.queue_id}_rrows"
    got = run_sql(dbq, "SELECT coalesce(pg_sequence_last_value('" + seq + "'), -1) + 1")
    return int(got[0][0])


def test_a_second_push_of_a_key_pushes_nothing_and_returns_the_first_id(dbq: DbQueue, design: str) -> None:
    q = make(dbq, "d", design)
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


def test_a_batch_maps_repeated_and_known_keys_to_their_first_message(dbq: DbQueue, design: str) -> None:
    q = make(dbq, "d", design)
    [a] = q.push_batch([{"k": "a"}], dedup_keys=["a"])
    # table design: stored in data, not in the meta row; a ring holds up to 4,000 bytes a payload
    big = {"k": "b", "pad": "x" * (5000 if design == "table" else 3900)}
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
    assert dedup_rows(dbq, q) == 3


def test_bad_keys_raise_at_once_and_push_nothing(dbq: DbQueue, design: str) -> None:
    q = make(dbq, "d", design)
    issued = rows_issued(dbq, q)
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
    assert q.stats().ready == 0 and dedup_rows(dbq, q) == 0 and rows_issued(dbq, q) == issued
    assert q.push_batch([], dedup_keys=[]) == []
    for window in (0, -1, float("nan"), "soon"):
        with pytest.raises(ConfigurationError, match="dedup_window"):
            make(dbq, "w", design, dedup_window=window)
    assert "w" not in {s.name for s in dbq.list_queues()}


def test_the_window_is_a_setting_of_the_queue(dbq: DbQueue, design: str) -> None:
    q = make(dbq, "d", design, dedup_window=42.5)
    assert q.settings.dedup_window_s == 42.5
    assert make(dbq, "d", design, dedup_window=42.5).settings.dedup_window_s == 42.5
    assert make(dbq, "e", design).settings.dedup_window_s == 300.0
    assert {s.name: s.dedup_window_s for s in dbq.list_queues()} == {"d": 42.5, "e": 300.0}
    from airflow_dbqueue.engine.errors import QueueExistsError

    with pytest.raises(QueueExistsError, match="dedup_window_s"):
        make(dbq, "d", design, dedup_window=10)


def test_a_ring_of_the_slots_layout_refuses_keys(dbq: DbQueue) -> None:
    r = dbq.create_queue("r", design="ring", capacity=16, layout="slots")
    with pytest.raises(NotSupportedError, match="slots layout: deduplication keys"):
        r.push("x", dedup_key="k")
    with pytest.raises(NotSupportedError, match="slots layout: deduplication keys"):
        r.push_batch(["x"], dedup_keys=["k"])
    # a window of its own would be a setting that does nothing: refused, and no ring created
    with pytest.raises(NotSupportedError, match="dedup_window applies to table queues and rings of the rows"):
        dbq.create_queue("r2", design="ring", capacity=16, layout="slots", dedup_window=60)
    assert r.stats().ready == 0 and {s.name for s in dbq.list_queues()} == {"r"}


def test_the_window_boundary(dbq: DbQueue, design: str) -> None:
    """A key pushed within the window (by the server's clock) is a duplicate; at the window's end it is
    taken over by the new push, which gets a new message. The key's time is set on the server, so the
    boundary is exact: the push's now() against pushed_at + window."""
    q = make(dbq, "d", design, dedup_window=60)
    first = q.push("one", dedup_key="k")
    set_age = (
        f"UPDATE {keys_table(q)} SET pushed_at = now() - make_interval(secs => %(age)s) WHERE dedup_key = 'k'"
    )
    run_sql(dbq, set_age, {"age": 59.9})
    assert q.push("two", dedup_key="k") == first
    with dbq.transaction() as conn:  # one now() for both statements: the key is exactly a window old
        run_sql(dbq, set_age, {"age": 60.0}, conn)
        second = q.push("three", dedup_key="k", conn=conn)
    assert second != first
    assert q.push("four", dedup_key="k") == second
    assert checksum(drain(q)) == checksum(["one", "three"])


def test_a_short_window_passes_and_the_upkeep_forgets_old_keys(dbq: DbQueue, design: str) -> None:
    q = make(dbq, "d", design, dedup_window=1.0)
    keys = [f"k{i}" for i in range(50)]
    ids = q.push_batch([f"a{i}" for i in range(50)], dedup_keys=keys)
    assert q.push_batch([f"b{i}" for i in range(50)], dedup_keys=keys) == ids
    assert q.maintain()["keys_forgotten"] == 0
    assert dbq.maintenance().recover()["d"]["keys_forgotten"] == 0
    time.sleep(1.2)
    report = dbq.maintenance().recover()
    assert report["d"]["keys_forgotten"] == 50 and dedup_rows(dbq, q) == 0
    again = q.push_batch([f"c{i}" for i in range(50)], dedup_keys=keys)
    assert not set(again) & set(ids) and dedup_rows(dbq, q) == 50
    time.sleep(1.2)
    taken_over = q.push_batch([f"d{i}" for i in range(25)], dedup_keys=keys[:25])  # before any upkeep
    assert not set(taken_over) & set(again)
    assert q.maintain(limit=10)["keys_forgotten"] == 10  # the upkeep's limit bounds one call
    assert q.maintain()["keys_forgotten"] == 15 and dedup_rows(dbq, q) == 25
    out = drain(q)
    expected = [f"a{i}" for i in range(50)] + [f"c{i}" for i in range(50)] + [f"d{i}" for i in range(25)]
    assert len(out) == len(expected) == 125
    assert checksum(out) == checksum(expected)


def test_a_retry_waits_for_the_first_push_and_gets_its_id(dbq: DbQueue, design: str) -> None:
    """A retried push of a key while the first push's transaction is open waits for it: after its
    commit the retry returns its id and pushes nothing; after its rollback the retry pushes. On a ring
    of the rows layout the waiting retry holds no row number: after the commit it took none, and after
    the rollback one (the rolled-back push's own number is the only gap)."""
    q = make(dbq, "d", design)
    got: list[int] = []

    def retry(payload: str) -> None:
        got.append(q.push(payload, dedup_key="k"))

    with dbq.transaction() as conn:
        first = q.push("first", dedup_key="k", conn=conn)
        t = threading.Thread(target=retry, args=("retry",))
        t.start()
        t.join(0.5)
        assert t.is_alive() and got == []  # waiting for the first push's transaction
        issued = rows_issued(dbq, q)
    t.join(10)
    assert got == [first] and rows_issued(dbq, q) == issued

    class Abort(Exception):
        pass

    got.clear()
    with pytest.raises(Abort), dbq.transaction() as conn:
        lost = q.push("rolled back", dedup_key="r", conn=conn)
        t = threading.Thread(target=retry_key, args=(q, "r", "retry", got))
        t.start()
        t.join(0.5)
        assert t.is_alive() and got == []
        issued = rows_issued(dbq, q)
        raise Abort
    t.join(10)
    assert len(got) == 1 and got[0] != lost
    assert issued is None or rows_issued(dbq, q) == issued + 1
    popped = q.pop(10)
    assert [(m.id, m.payload) for m in popped] == [(first, "first"), (got[0], "retry")]


def retry_key(q: Queue, key: str, payload: str, got: list[int]) -> None:
    got.append(q.push(payload, dedup_key=key))


KEYS = 400


def test_racing_threads_push_each_key_once(dbq: DbQueue, design: str) -> None:
    """Eight threads push the same keys (each in its own order, batches of 20, some with the same key
    twice): every thread gets the same id for a key, and the queue holds one message a key, the payload
    of the push that won."""
    q = make(dbq, "d", design)
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


def test_racing_processes_push_each_key_once(dbq: DbQueue, design: str) -> None:
    q = make(dbq, "d", design)
    ctx = child_processes()
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
    dbq: DbQueue, pg_dsn: str, design: str
) -> None:
    """At REPEATABLE READ a key that another push committed after the caller's snapshot raises a
    serialization failure (TransientDatabaseError); run again, the transaction gets the first id."""
    q = make(dbq, "d", design)
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


def test_an_exactly_once_producer_remembers_a_key_only_when_it_commits(dbq: DbQueue, design: str) -> None:
    """A push in the caller's transaction (conn=) whose transaction rolls back forgets its key with its
    message: the next push of the key pushes; one that commits is remembered."""
    q = make(dbq, "d", design)

    class Abort(Exception):
        pass

    with pytest.raises(Abort), dbq.transaction() as conn:
        lost = q.push_batch(["lost-a", "lost-b"], dedup_keys=["a", "b"], conn=conn)
        assert q.push("again", dedup_key="a", conn=conn) == lost[0]  # its own transaction sees it
        raise Abort
    assert dedup_rows(dbq, q) == 0 and q.stats().ready == 0
    with dbq.transaction() as conn:
        kept = q.push_batch(["a", "b"], dedup_keys=["a", "b"], conn=conn)
    assert q.push_batch(["a2", "b2", "c"], dedup_keys=["a", "b", "c"])[:2] == kept
    out = drain(q)
    assert len(out) == 3 and checksum(out) == checksum(["a", "b", "c"])


def rows_ring(dbq: DbQueue, name: str, **settings: Any) -> Queue:
    return make(dbq, name, "rows", **settings)


def test_a_partly_known_batch_pushes_only_its_new_messages_as_one_row(dbq: DbQueue) -> None:
    """On a ring of the rows layout a batch whose keys are partly known pushes its new messages, in
    batch order, as one row (ids following from its number); a batch of known keys only takes no row
    number at all, so it leaves no gap."""
    q = rows_ring(dbq, "d")
    first = q.push_batch(["a", "b"], dedup_keys=["a", "b"])
    assert first == [0, 1] and rows_issued(dbq, q) == 1
    ids = q.push_batch(["x", "a2", "y", "b2", "z", "y2"], dedup_keys=["x", "a", "y", "b", "z", "y"])
    assert rows_issued(dbq, q) == 2
    row = 1 << 16  # the second row's first id: its three new messages, in batch order
    assert ids == [row, first[0], row + 1, first[1], row + 2, row + 1]
    assert q.push_batch(["a3", "z3"], dedup_keys=["a", "z"]) == [first[0], row + 2]
    assert rows_issued(dbq, q) == 2 and q.stats().extra["rows_held"] == 2
    st = q.stats()
    assert st.ready == 5 and st.extra["push_total"] == 5
    popped = q.pop(10)
    assert sorted(m.id for m in popped) == sorted({*first, row, row + 1, row + 2})
    assert checksum(m.payload for m in popped) == checksum(["a", "b", "x", "y", "z"])
    assert drained(q) and dedup_rows(dbq, q) == 5


def test_a_keyed_push_that_meets_a_full_ring_keeps_no_key(dbq: DbQueue) -> None:
    """A keyed push that claimed its keys (after waiting for another push of one of them) and then finds
    the ring full gives its keys up with its push: nothing is remembered of a push that pushed nothing,
    and a later push of the keys pushes them."""
    q = rows_ring(dbq, "d", capacity=16, lanes=2)  # four segments of 4 rows: rows 0-15 before a rotation
    for i in range(14):
        q.push(f"p{i}")  # rows 0-13
    assert rows_issued(dbq, q) == 14
    b = dbq.queue("d")
    b.push_timeout = 0.5  # type: ignore[attr-defined]
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            b.push_batch(["k", "k2"], dedup_keys=["k", "k2"])
        except BaseException as exc:
            errors.append(exc)

    class Abort(Exception):
        pass

    with pytest.raises(Abort), dbq.transaction() as conn:
        q.push("held", dedup_key="k", conn=conn)  # row 14, rolled back below
        t = threading.Thread(target=blocked)
        t.start()
        t.join(0.5)
        assert t.is_alive()  # waiting on key k, holding no row number
        q.push("last")  # row 15: the next push needs a rotation that no pop has allowed
        assert rows_issued(dbq, q) == 16
        raise Abort
    t.join(30)
    assert len(errors) == 1 and isinstance(errors[0], QueueFullError), errors
    assert dedup_rows(dbq, q) == 0 and rows_issued(dbq, q) == 16
    out = drain(q)
    expected = [f"p{i}" for i in range(14)] + ["last"]
    assert len(out) == len(expected) and checksum(out) == checksum(expected)
    ids = q.push_batch(["k", "k2"], dedup_keys=["k", "k2"])
    assert len(set(ids)) == 2 and q.push("k again", dedup_key="k") == ids[0]
    # The rolled-back push left row 14 unwritten, a gap in front of lane 0, where the keys' row lands: a
    # pop gives it up once every transaction with an xid that ran when it looked has ended, which may
    # take a look more than the first drain when another one (an autoanalyze) ran then.
    got: list[Any] = []
    deadline = time.monotonic() + 10.0
    while len(got) < 2 and time.monotonic() < deadline:
        got += [m.payload for m in q.pop(10)]
    assert checksum(got) == checksum(["k", "k2"]) and drained(q)


def test_a_retry_of_known_keys_into_a_full_ring_returns_the_first_ids(dbq: DbQueue) -> None:
    """A push whose keys are all known needs no room: into a full ring it returns the first pushes' ids
    and pushes nothing, as into one with room. A push with a key not known (new, or a window old) needs
    a row, and a full ring refuses it with QueueFullError, keeping no key and taking no row number."""
    q = rows_ring(dbq, "d", capacity=16, lanes=2, dedup_window=60)
    first = q.push_batch(["a", "b"], dedup_keys=["a", "b"])
    for i in range(15):
        q.push(f"p{i}")  # rows 1-15: the next push needs a rotation that no pop has allowed
    q.push_timeout = 0.2
    with pytest.raises(QueueFullError):
        q.push("full")
    issued = rows_issued(dbq, q)
    assert q.push_batch(["a2", "b2", "a3"], dedup_keys=["a", "b", "a"]) == [first[0], first[1], first[0]]
    assert q.push("b4", dedup_key="b") == first[1]
    for keys in (["a", "c"], ["c"]):
        with pytest.raises(QueueFullError):
            q.push_batch([f"{k}5" for k in keys], dedup_keys=keys)
    run_sql(dbq, f"UPDATE {keys_table(q)} SET pushed_at = now() - interval '60 s' WHERE dedup_key = 'b'")
    with pytest.raises(QueueFullError):  # b is a window old: taken over by a push that needs a row
        q.push("b6", dedup_key="b")
    assert rows_issued(dbq, q) == issued and dedup_rows(dbq, q) == 2
    st = q.stats()
    assert st.ready == 17 and st.extra["push_total"] == 17
    out = drain(q)
    expected = ["a", "b"] + [f"p{i}" for i in range(15)]
    assert len(out) == len(expected) and checksum(out) == checksum(expected)
    assert q.push_batch(["a7", "b7", "c7"], dedup_keys=["a", "b", "c"])[0] == first[0]
    assert checksum(drain(q)) == checksum(["b7", "c7"])


def test_keys_on_a_ring_with_groups_expiry_and_rotations(dbq: DbQueue) -> None:
    """Keyed pushes into a small ring that rotates its segments many times, expiring and with a second
    consumer group: every group takes each key's message once, the keys outlive their segments, and a
    group's own objects hold no key table of theirs."""
    q = rows_ring(dbq, "d", capacity=16, lanes=2, ttl=60)
    q.add_group("audit")  # type: ignore[attr-defined]
    g = q.group("audit")  # type: ignore[attr-defined]
    pushed: list[str] = []
    seen: dict[str, int] = {}
    took: dict[str, list[Any]] = {"default": [], "audit": []}
    for i in range(60):
        batch = [f"k{i}", f"k{i - 1}", f"k{i}"] if i else ["k0"]
        ids = q.push_batch([f"{k}@{i}" for k in batch], dedup_keys=batch)
        pushed.append(f"k{i}@{i}")
        for k, id_ in zip(batch, ids, strict=True):
            assert seen.setdefault(k, id_) == id_
        if i % 3 == 2:  # the ring holds 16 pushes: both groups take as they go
            took["default"] += [m.payload for m in q.pop(10)]
            took["audit"] += [m.payload for m in g.pop(10)]
    took["default"] += drain(q)
    took["audit"] += drain(g)
    for who, got in took.items():
        assert len(got) == 60 and checksum(got) == checksum(pushed), who
    assert len(set(seen.values())) == 60 and dedup_rows(dbq, q) == 60
    assert q.stats().extra["push_total"] == 60 and q.push("late", dedup_key="k0") == seen["k0"]
    qid = q.settings.queue_id
    assert run_sql(dbq, f"SELECT count(*) FROM {{schema}}.ring_{qid}_rq WHERE expires_at IS NULL") == [(0,)]
    own = run_sql(
        dbq,
        "SELECT count(*) FROM pg_catalog.pg_class c WHERE c.relnamespace = '{schema}'::regnamespace"
        " AND c.relname ~ '^ring_g.*(keys|push|forget)'",
    )
    assert own == [(0,)]
    assert drain(q) == [] and drain(g) == []
    dbq.drop_queue("d")
    assert run_sql(dbq, f"SELECT to_regclass('{{schema}}.ring_{qid}_rkeys') IS NULL") == [(True,)]


def test_the_cli_pushes_with_keys_into_a_ring_of_the_rows_layout(
    dbq: DbQueue, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through dbqueue's main(): create a rows ring with --dedup-window, push with --dedup-key (a key
    repeated and a retry), and the upkeep's count of the keys it forgot."""
    import json

    from airflow_dbqueue import cli

    base = ["--dsn", dbq.db.dsn, "--schema", dbq.schema]
    create = ["create", "r", "--design", "ring", "--layout", "rows", "--capacity", "64", "--lanes", "2"]
    assert cli.main([*base, *create, "--dedup-window", "30"]) == 0
    capsys.readouterr()
    q = dbq.queue("r")
    assert q.settings.dedup_window_s == 30.0
    push = [*base, "push", "r", '{"n": 1}', '{"n": 2}', '{"n": 1, "again": 1}']
    assert cli.main([*push, "--dedup-key", "a", "--dedup-key", "b", "--dedup-key", "a"]) == 0
    ids = json.loads(capsys.readouterr().out)["ids"]
    assert ids[0] == ids[2] != ids[1]
    assert cli.main([*base, "push", "r", '{"n": 2, "retry": 1}', "--dedup-key", "b"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == [ids[1]]
    run_sql(dbq, f"UPDATE {keys_table(q)} SET pushed_at = now() - interval '31 s'")
    assert dbq.maintenance().recover()["r"]["keys_forgotten"] == 2 and dedup_rows(dbq, q) == 0
    out = drain(q)
    assert len(out) == 2 and checksum(out) == checksum([{"n": 1}, {"n": 2}])


def test_a_keyed_push_reads_its_keys_by_their_index(dbq: DbQueue) -> None:
    """The key table of a ring of the rows layout holds a window's keys: a keyed push (of new keys,
    partly known ones, known ones only) finds the rows it claimed by their row versions and the known
    ones by the key's index, and never scans the table (3,000 keys: a few dozen pages); the update that
    gives a claimed key its id is a HOT update."""
    q = rows_ring(dbq, "d")
    for b in range(10):
        q.push_batch([f"a{b}-{i}" for i in range(300)], dedup_keys=[f"a{b}-{i}" for i in range(300)])
    stats = (
        "SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0), n_tup_upd, n_tup_hot_upd"
        " FROM pg_catalog.pg_stat_xact_user_tables"
        f" WHERE relid = '{keys_table(q)}'::regclass"
    )
    with dbq.transaction() as conn:
        # the backend's counts not reported yet, which may hold its earlier transactions' too
        [before] = run_sql(dbq, stats, None, conn)
        q.push_batch(["b0", "b1"], dedup_keys=["b0", "b1"], conn=conn)
        q.push_batch(["a0-0", "c0", "b1"], dedup_keys=["a0-0", "c0", "b1"], conn=conn)
        q.push_batch(["a0-1", "c0"], dedup_keys=["a0-1", "c0"], conn=conn)
        [after] = run_sql(dbq, stats, None, conn)
    seq, idx, upd, hot = (a - b for a, b in zip(after, before, strict=True))
    assert seq == 0 and idx > 0, (seq, idx)
    # the three new keys got their ids by updates that stayed on their pages (fillfactor 50): HOT
    assert upd == hot == 3, (upd, hot)
    out = drain(q)
    expected = [f"a{b}-{i}" for b in range(10) for i in range(300)] + ["b0", "b1", "c0"]
    assert len(out) == len(expected) and checksum(out) == checksum(expected)


def test_a_ring_made_before_keys_refuses_them_and_pushes_as_before(dbq: DbQueue) -> None:
    """A ring of the rows layout keeps the functions it was made with: one made by a build without the
    keyed push (its rpushk and rforget dropped here, as such a ring lacks them) refuses keys with
    NotSupportedError, writing nothing, and pushes without keys and runs its upkeep as before."""
    q = rows_ring(dbq, "d")
    qid = q.settings.queue_id
    run_sql(dbq, f"DROP FUNCTION {{schema}}.ring_{qid}_rpushk, {{schema}}.ring_{qid}_rforget")
    old = dbq.queue("d")
    issued = rows_issued(dbq, old)
    with pytest.raises(NotSupportedError, match="made by a build without deduplication keys"):
        old.push("x", dedup_key="k")
    assert rows_issued(dbq, old) == issued and dedup_rows(dbq, old) == 0
    ids = old.push_batch(["a", "b"])
    assert old.maintain()["keys_forgotten"] == 0
    popped = old.pop(10)
    assert [m.id for m in popped] == ids and checksum(m.payload for m in popped) == checksum(["a", "b"])
