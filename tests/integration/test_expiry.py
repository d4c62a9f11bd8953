"""Message expiry (table design): a message not popped within its time to live is never delivered; it
goes to the failed state with last_error "expired" (listed, counted, requeued) or is dropped
(on_expiry="drop"), by the sweep of the pops (a queue with a ttl) or of the upkeep.

Every test counts what went in and what came out, and compares checksums of the payloads.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import pytest

from airflow_dbqueue.engine.errors import ConfigurationError, LeaseExpiredError, NotSupportedError
from airflow_dbqueue.engine.models import OnExpiry
from tests.dialects import expire_leases, run_sql
from tests.helpers import checksum, drained

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Queue

pytestmark = pytest.mark.integration

AGE = (
    "UPDATE {schema}.meta_opt SET expires_at = now() + make_interval(secs => %(left)s) "
    "WHERE id = ANY (%(ids)s)"
)
"""Set the messages' expiry relative to the server's clock: the boundary is then exact."""


def drain(q: Queue) -> list[Any]:
    out: list[Any] = []
    while batch := q.pop(500):
        out += [m.payload for m in batch]
    return out


def test_no_pop_hands_out_an_expired_message_before_any_sweep(dbq: DbQueue) -> None:
    """No pop takes an expired message, at most, at least or exactly once, nor a batch claim, peek or
    what the observers count, before anything swept it (the pops' sweep is kept from running here)."""
    q = dbq.create_queue("q", ttl=3600)
    q.reclaim_every = 3600  # type: ignore[attr-defined]
    q._last_reclaim = time.monotonic()  # type: ignore[attr-defined]
    live = q.push_batch([f"live{i}" for i in range(5)], ttl=7200)
    doomed = q.push_batch([f"doomed{i}" for i in range(5)])
    run_sql(dbq, AGE, {"left": 0.0, "ids": doomed[:3]})  # expired from the next statement on
    run_sql(dbq, AGE, {"left": -10.0, "ids": doomed[3:4]})
    assert q.count_ready() == 6 and len(q.peek(100)) == 6
    assert q.readiness()[1] == (live[0], 0)
    [m] = q.pop(1, semantics="at-least-once")
    batch = q.claim_batch(100)
    assert batch is not None and [i for i, _ in batch.receipts] == [*live[1:], doomed[4]]
    with dbq.transaction() as conn:
        assert q.pop(100, semantics="exactly-once", conn=conn) == []
    assert q.pop(100) == []
    assert q.stats().ready == 4  # counted ready until a sweep moves them
    assert q.maintain()["expired"] == 4
    st = q.stats()
    assert (st.ready, st.failed, st.in_flight, st.extra["expired"]) == (0, 4, 6, 4)
    failed = q.list_failed()
    assert sorted(f.id for f in failed) == sorted(doomed[:4])
    assert {f.last_error for f in failed} == {"expired"}
    assert q.ack([m]) == 1 and q.ack_batch(batch.batch_id) == 5
    assert q.requeue_failed() == 4  # deliverable again, without a ttl
    out = drain(q)
    assert checksum(out) == checksum([f"doomed{i}" for i in range(4)]) and drained(q)


def test_the_boundary_of_a_queues_ttl(dbq: DbQueue) -> None:
    """With a queue ttl every push expires; a message with time left is popped, one at its expiry is
    not, and the pops' own sweep moves it to failed."""
    q = dbq.create_queue("q", ttl=3600)
    assert q.settings.ttl_s == 3600 and q.settings.on_expiry is OnExpiry.FAIL
    ids = q.push_batch(["a", "b", "c"])
    assert run_sql(dbq, "SELECT count(*) FROM {schema}.meta_opt WHERE expires_at IS NOT NULL") == [(3,)]
    with dbq.transaction() as conn:  # one now() for all: "a" has a microsecond left, "b" none
        run_sql(dbq, AGE, {"left": 0.000001, "ids": ids[:1]}, conn)
        run_sql(dbq, AGE, {"left": 0.0, "ids": ids[1:2]}, conn)
        got = q.pop(10, semantics="exactly-once", conn=conn)
    assert [m.payload for m in got] == ["a", "c"]
    assert [(f.id, f.last_error) for f in q.list_failed()] == [(ids[1], "expired")]  # swept by the pop
    assert q.stats().extra == {"expired": 1}


def test_a_short_ttl_passes_in_real_time(dbq: DbQueue) -> None:
    q = dbq.create_queue("q", ttl=60)
    kept = q.push_batch([f"k{i}" for i in range(20)])
    short = q.push_batch([f"s{i}" for i in range(30)], ttl=0.3)
    assert len(kept) == 20 and len(short) == 30
    time.sleep(0.5)
    q._last_reclaim = time.monotonic()  # type: ignore[attr-defined]  # its pops do not sweep now
    out = drain(q)
    assert checksum(out) == checksum([f"k{i}" for i in range(20)])
    report = dbq.maintenance().recover()
    assert report["q"]["expired"] == 30
    assert sorted(f.id for f in q.list_failed()) == short
    assert checksum(f.payload for f in q.list_failed()) == checksum([f"s{i}" for i in range(30)])


def test_on_expiry_drop_deletes_or_archives(dbq: DbQueue) -> None:
    for archive in (False, True):
        name = f"d{int(archive)}"
        q = dbq.create_queue(name, ttl=3600, on_expiry="drop", archive=archive)
        ids = q.push_batch([f"x{i}" for i in range(4)] + [{"big": "y" * 5000}])
        run_sql(dbq, AGE, {"left": -1.0, "ids": ids[2:]})
        assert q.maintain()["expired"] == 3
        st = q.stats()
        assert (st.ready, st.failed, st.finished) == (2, 0, 3 if archive else 0)
        assert q.list_failed() == []
        assert checksum(drain(q)) == checksum(["x0", "x1"])
        data = run_sql(dbq, "SELECT count(*) FROM {schema}.data d WHERE d.id = %(id)s", {"id": ids[4]})
        assert data == [(1 if archive else 0,)]  # the large payload goes with its message, or to archive


def test_a_leased_message_is_not_expired_until_it_comes_back(dbq: DbQueue) -> None:
    """Expiry is about waiting to be popped: a leased message is its consumer's; nacked after its time
    to live, it is not delivered again but expires."""
    q = dbq.create_queue("q", ttl=3600, retry_backoff=0)
    [i] = q.push_batch(["m"])
    [m] = q.pop(1, semantics="at-least-once")
    run_sql(dbq, AGE, {"left": -1.0, "ids": [i]})
    assert q.expire_messages() == 0
    assert q.nack([m], delay=0) == 1
    assert q.pop(1, semantics="at-least-once") == []
    assert q.expire_messages() == 1
    assert [(f.id, f.payload, f.last_error) for f in q.list_failed()] == [(i, "m", "expired")]


def test_bad_ttls_raise_at_once_and_push_nothing(dbq: DbQueue) -> None:
    plain = dbq.create_queue("plain")
    with pytest.raises(ConfigurationError, match="queue created with a ttl"):
        plain.push("x", ttl=10)
    q = dbq.create_queue("q", ttl=3600)
    for ttl in (0, -1, float("inf"), "soon"):
        with pytest.raises(ConfigurationError, match="ttl"):
            q.push("x", ttl=ttl)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="expire before it is due"):
        q.push("x", ttl=10, delay=10)
    for bad in ({"ttl": 0}, {"on_expiry": "later"}):
        with pytest.raises(ConfigurationError):
            dbq.create_queue("w", **bad)  # type: ignore[arg-type]
    with pytest.raises(NotSupportedError, match="ttl applies to table queues and rings of the rows layout"):
        dbq.create_queue("w", design="ring", ttl=10, layout="slots")
    with pytest.raises(NotSupportedError, match="on_expiry='drop' applies to table queues and rings"):
        dbq.create_queue("w", design="ring", on_expiry="drop", layout="slots")
    r = dbq.create_queue("r", design="ring", capacity=16, layout="slots")
    with pytest.raises(NotSupportedError, match="slots layout: expiry"):
        r.push("x", ttl=10)
    assert q.stats().ready == 0 and r.stats().ready == 0 and plain.stats().ready == 0
    assert "w" not in {s.name for s in dbq.list_queues()}


def test_ttl_and_dedup_keys_together(dbq: DbQueue) -> None:
    q = dbq.create_queue("q", dedup_window=60, ttl=7200)
    first = q.push("a", dedup_key="k", ttl=3600)
    assert q.push("a again", dedup_key="k", ttl=3600) == first
    run_sql(dbq, AGE, {"left": -1.0, "ids": [first]})
    assert q.push("a once more", dedup_key="k") == first  # the key outlives its message's ttl
    assert q.pop(10) == []  # not delivered; this pop's own sweep (a queue with a ttl) moved it to failed
    assert q.maintain()["expired"] == 0
    assert [(f.payload, f.last_error) for f in q.list_failed()] == [("a", "expired")]


# -- the ring's rows layout: expiry decided at pop time, recorded as a row ---------------------------


def _age_rows(dbq: DbQueue, q: Queue, ids: list[int], left: float, conn: Any = None) -> None:
    """Set the expiry of the rows holding ``ids`` relative to the server's clock (a test's own write:
    the engine itself never updates a row of the ring)."""
    rows = sorted({i >> 16 for i in ids})
    for k in range(4):
        run_sql(
            dbq,
            f"UPDATE {{schema}}.ring_{q.settings.queue_id}_rq{k} SET expires_at = now() + "
            "make_interval(secs => %(left)s) WHERE r = ANY (%(rows)s)",
            {"left": left, "rows": rows},
            conn,
        )


def rows_ring(dbq: DbQueue, name: str, **kw: Any) -> Queue:
    kw.setdefault("ttl", 3600)
    kw.setdefault("lanes", 2)
    return dbq.create_queue(name, design="ring", layout="rows", capacity=64, **kw)


@pytest.mark.parametrize("semantics", ["at-most-once", "at-least-once", "exactly-once"])
@pytest.mark.parametrize("one", [True, False])
def test_a_rows_ring_never_hands_out_an_expired_message(dbq: DbQueue, semantics: str, one: bool) -> None:
    """Pops of one and of many, each semantics: an expired push is passed and recorded as failed with
    last_error "expired" (listed, counted), the others delivered in order; nothing is lost."""
    q = rows_ring(dbq, "r")
    batches = [q.push_batch([f"p{b}.{i}" for i in range(3)]) for b in range(6)]
    doomed = batches[0] + batches[3] + batches[4]
    _age_rows(dbq, q, doomed, -1.0)
    out: list[Any] = []
    while True:
        if semantics == "exactly-once":
            with dbq.transaction() as conn:
                got = q.pop(1 if one else 4, semantics="exactly-once", conn=conn)
        else:
            got = q.pop(1 if one else 4, semantics=semantics)
            if semantics == "at-least-once" and got:
                assert q.ack(got) == len(got)
        if not got:
            break
        out += got
    assert not set(m.id for m in out) & set(doomed)
    kept = [i for b in (1, 2, 5) for i in batches[b]]
    assert sorted(m.id for m in out) == kept
    assert checksum(m.payload for m in out) == checksum(f"p{b}.{i}" for b in (1, 2, 5) for i in range(3))
    failed = q.list_failed()
    assert sorted(f.id for f in failed) == sorted(doomed)
    assert {f.last_error for f in failed} == {"expired"}
    assert checksum(f.payload for f in failed) == checksum(f"p{b}.{i}" for b in (0, 3, 4) for i in range(3))
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed) == (0, 0, 9)
    assert q.requeue_failed() == 9  # deliverable again, without a ttl
    again = drain(q)
    assert checksum(again) == checksum(f"p{b}.{i}" for b in (0, 3, 4) for i in range(3))


def test_the_boundary_on_a_rows_ring(dbq: DbQueue) -> None:
    """One now() for the pop and the expiries: a push with a microsecond left is popped, one at its
    expiry is not. Each push is a row, so its messages expire together."""
    q = rows_ring(dbq, "r")
    a = q.push_batch(["a0", "a1"])
    b = q.push_batch(["b0"])
    with dbq.transaction() as conn:
        _age_rows(dbq, q, a, 0.000001, conn)
        _age_rows(dbq, q, b, 0.0, conn)
        got = q.pop(10, semantics="exactly-once", conn=conn)
    assert [m.payload for m in got] == ["a0", "a1"]
    assert [(f.id, f.payload, f.last_error) for f in q.list_failed()] == [(b[0], "b0", "expired")]


def test_a_short_ttl_on_a_rows_ring_passes_in_real_time(dbq: DbQueue) -> None:
    """A push's own ttl (the queue's is its default) in real time, a part of a row already taken before
    it expired: only the rest of that row expires. A leased message is its consumer's; nacked after its
    time to live, it is not delivered again but expires, as on the table design."""
    q = rows_ring(dbq, "r", ttl=60, retry_backoff=0)
    kept = q.push_batch([f"k{i}" for i in range(5)])
    short = q.push_batch([f"s{i}" for i in range(6)], ttl=0.3)
    first = q.pop(7, semantics="at-least-once")  # k0..k4, s0, s1
    assert [m.payload for m in first] == [*(f"k{i}" for i in range(5)), "s0", "s1"]
    time.sleep(0.5)
    assert q.pop(10) == []
    assert sorted(f.id for f in q.list_failed()) == short[2:]
    assert q.nack(first[5:6], delay=0) == 1  # leased before its expiry, nacked after it
    assert q.ack(first[:5]) == 5 and kept == [m.id for m in first[:5]]
    assert drain(q) == []
    failed = q.list_failed()
    assert sorted(f.id for f in failed) == [short[0], *short[2:]]
    assert {f.last_error for f in failed} == {"expired"}
    assert checksum(f.payload for f in failed) == checksum(["s0", *(f"s{i}" for i in range(2, 6))])
    assert q.ack(first[6:]) == 1  # still its consumer's: the ack closes it
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed) == (0, 0, 5)


def test_on_expiry_drop_on_a_rows_ring(dbq: DbQueue) -> None:
    q = rows_ring(dbq, "r", on_expiry="drop", retry_backoff=0)
    ids = q.push_batch(["x0", "x1"])
    gone = q.push_batch(["y0", "y1", "y2"])
    [m] = q.pop(1, semantics="at-least-once")
    _age_rows(dbq, q, [*ids, *gone], -1.0)
    assert q.nack([m], delay=0) == 1  # due again after its expiry: dropped too
    assert drain(q) == [] and m.payload == "x0"
    st = q.stats()
    assert q.list_failed() == [] and (st.failed, st.ready, st.in_flight) == (0, 0, 0)


def test_a_rows_ring_with_groups_expires_for_each_group(dbq: DbQueue) -> None:
    """Each consumer group passes an expired push on its own pops and records it as its failed one."""
    q = rows_ring(dbq, "r")
    g = q.add_group("audit", start="earliest")  # type: ignore[attr-defined]
    ok = q.push_batch(["a", "b"])
    doomed = q.push_batch(["c"])
    _age_rows(dbq, q, doomed, -1.0)
    assert checksum(drain(q)) == checksum(["a", "b"])
    assert checksum(drain(g)) == checksum(["a", "b"])
    assert [f.id for f in q.list_failed()] == doomed == [f.id for f in g.list_failed()]
    assert len(ok) == 2


def test_bad_ttls_on_a_rows_ring_raise_at_once_and_push_nothing(dbq: DbQueue) -> None:
    plain = dbq.create_queue("plain", design="ring", layout="rows", capacity=64, lanes=2)
    with pytest.raises(ConfigurationError, match="queue created with a ttl"):
        plain.push("x", ttl=10)
    q = rows_ring(dbq, "r")
    for ttl in (0, -1, float("inf"), "soon"):
        with pytest.raises(ConfigurationError, match="ttl"):
            q.push("x", ttl=ttl)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        rows_ring(dbq, "w", ttl=0)
    assert q.stats().ready == 0 and plain.stats().ready == 0
    assert "w" not in {s.name for s in dbq.list_queues()}


def test_concurrent_pops_of_a_rows_ring_pass_expired_pushes_once(dbq: DbQueue) -> None:
    """Four consumers (pops of one and of three, at least once) drain a rows ring whose every other push
    expired: each live message is delivered once, each expired one recorded once, none lost."""
    q = rows_ring(dbq, "r", ttl=60)
    live: list[str] = []
    doomed: list[str] = []
    for b in range(60):
        payloads = [f"m{b}.{i}" for i in range(1 + b % 3)]
        if b % 2:
            q.push_batch(payloads, ttl=0.2)
            doomed += payloads
        else:
            q.push_batch(payloads)
            live += payloads
    time.sleep(0.4)
    got: list[list[Any]] = [[] for _ in range(4)]

    def consume(k: int) -> None:
        h = dbq.queue("r")
        while batch := h.pop(1 if k % 2 else 3, semantics="at-least-once"):
            assert h.ack(batch) == len(batch)
            got[k] += [m.payload for m in batch]

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out = [p for g in got for p in g]
    assert len(out) == len(live) and checksum(out) == checksum(live)
    failed = q.list_failed(limit=1000)
    assert len(failed) == len(doomed) and checksum(f.payload for f in failed) == checksum(doomed)
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed) == (0, 0, len(doomed))


def test_batches_and_reclaimed_leases_of_a_rows_ring_expire(dbq: DbQueue) -> None:
    """A claim passes expired pushes as a pop does; a lease reclaimed after its messages' expiry is not
    delivered again, its messages expire."""
    q = rows_ring(dbq, "r", retry_backoff=0)
    held = q.push_batch(["h0", "h1"])
    [m0, m1] = q.pop(2, semantics="at-least-once")
    doomed = q.push_batch(["d0", "d1"])
    live = q.push_batch(["l0", "l1", "l2"])
    _age_rows(dbq, q, [*held, *doomed], -1.0)
    batch = q.claim_batch(100)
    assert batch is not None and [i for i, _ in batch.receipts] == live
    expire_leases(dbq, held, q)
    assert q.reclaim_expired() == 2
    assert q.pop(10, semantics="at-least-once") == []
    assert q.ack_batch(batch.batch_id) == 3
    failed = q.list_failed()
    assert sorted(f.id for f in failed) == sorted([*held, *doomed])
    assert checksum(f.payload for f in failed) == checksum(["h0", "h1", "d0", "d1"])
    with pytest.raises(LeaseExpiredError):
        q.ack([m0, m1])
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed) == (0, 0, 4)


def test_stats_of_a_rows_ring_count_expiry_before_and_after_a_pop_reaches_it(dbq: DbQueue) -> None:
    """A rows ring's stats count the messages past their time to live that no pop has reached yet apart
    (extra["expired_pending"], neither ready nor delayed), and the failed ones that failed by expiry as
    the table design does (extra["expired"]); a pop moves the first to the second. A message due again
    after its expiry (nacked with a delay) is pending too, once its row expired."""
    q = rows_ring(dbq, "r", retry_backoff=0)
    plain = dbq.create_queue("plain", design="ring", layout="rows", capacity=64, lanes=2)
    live = q.push_batch([f"l{i}" for i in range(3)])
    held = q.push_batch(["h0", "h1"])
    doomed = q.push_batch([f"d{i}" for i in range(4)])
    st = q.stats()
    assert (st.ready, st.extra["expired"], st.extra["expired_pending"]) == (9, 0, 0)
    got = q.pop(5, semantics="at-least-once")  # live and held: 5 in flight
    assert [m.id for m in got] == [*live, *held]
    assert q.nack(got[3:], delay=3600) == 2  # held: delayed
    _age_rows(dbq, q, [*held, *doomed], -1.0)
    st = q.stats()
    assert (st.ready, st.delayed, st.in_flight, st.failed) == (0, 0, 3, 0)
    assert (st.extra["expired"], st.extra["expired_pending"], st.extra["lag_messages"]) == (0, 6, 3)
    # the pending ones are not popped yet: 9 pushed, none finished (3 in flight, 6 expired, unreached)
    assert (st.extra["push_total"], st.extra["pop_total"]) == (9, 0)
    assert st.oldest_ready_age_s is None  # no ready message: the expired ones are not ready
    assert q.pop(10, semantics="at-least-once") == []  # reaches the doomed row, not the delayed held
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed) == (0, 3, 4)
    assert (st.extra["expired"], st.extra["expired_pending"]) == (4, 2)
    assert (st.extra["push_total"], st.extra["pop_total"]) == (9, 4)  # the 4 the pop failed
    assert q.ack(got[:3]) == 3
    for k in range(4):  # the delayed pair due now: a pop fails them as expired
        run_sql(
            dbq,
            f"UPDATE {{schema}}.ring_{q.settings.queue_id}_rr{k} SET due_at = now() WHERE id = ANY (%(ids)s)",
            {"ids": held},
        )
    assert q.stats().extra["expired_pending"] == 2
    assert q.pop(10) == []
    st = q.stats()
    assert (st.ready, st.delayed, st.in_flight, st.failed) == (0, 0, 0, 6)
    assert (st.extra["expired"], st.extra["expired_pending"]) == (6, 0)
    assert (st.extra["push_total"], st.extra["pop_total"]) == (9, 9)
    failed = q.list_failed()
    assert sorted(f.id for f in failed) == sorted([*held, *doomed])
    assert {f.last_error for f in failed} == {"expired"}
    assert checksum(f.payload for f in failed) == checksum(["h0", "h1", *(f"d{i}" for i in range(4))])
    assert "expired" not in plain.stats().extra and "expired_pending" not in plain.stats().extra
    assert q.requeue_failed() == 6
    st = q.stats()
    assert (st.ready, st.failed, st.extra["expired"], st.extra["expired_pending"]) == (6, 0, 0, 0)


def test_stats_of_a_dropping_rows_ring_and_of_its_groups(dbq: DbQueue) -> None:
    """on_expiry="drop": pending ones are counted until a pop drops them, and none is failed. Each
    consumer group counts its own."""
    q = rows_ring(dbq, "r", on_expiry="drop")
    d = rows_ring(dbq, "d", on_expiry="drop")
    g = q.add_group("audit", start="earliest")  # type: ignore[attr-defined]
    for h in (q, d):
        ok = h.push_batch(["a", "b"])
        gone = h.push_batch(["c", "d", "e"])
        _age_rows(dbq, h, gone, -1.0)
        assert (h.stats().ready, h.stats().extra["expired_pending"]) == (2, 3) and len(ok) == 2
    assert checksum(drain(d)) == checksum(["a", "b"])
    st = d.stats()
    assert (st.ready, st.failed, st.extra["expired"], st.extra["expired_pending"]) == (0, 0, 0, 0)
    assert checksum(drain(q)) == checksum(["a", "b"])
    assert (q.stats().extra["expired_pending"], g.stats().extra["expired_pending"]) == (0, 3)
    assert g.stats().ready == 2 and g.stats().extra["lag_messages"] == 2
    assert checksum(drain(g)) == checksum(["a", "b"])
    assert g.stats().extra["expired_pending"] == 0 and d.list_failed() == [] and q.list_failed() == []


def test_a_pop_of_a_rows_ring_that_passes_expired_rows_after_messages_due_again_takes_at_most_n(
    dbq: DbQueue,
) -> None:
    """A pop serves a message due again, locks the one lane it still wants, finds only an expired row
    there and looks again: it looks for what it still wants, so pop(2) returns two messages, not three,
    and the third stays ready."""
    q = rows_ring(dbq, "r", lanes=3, retry_backoff=0)
    a = q.push_batch(["a"])  # row 0, lane 0
    b = q.push_batch(["b"])  # row 1, lane 1
    c = q.push_batch(["c0", "c1"])  # row 2, lane 2
    [m] = q.pop(1, semantics="at-least-once")
    d = q.push_batch(["d"])  # row 3, lane 0
    _age_rows(dbq, q, b, -1.0)
    assert m.id == a[0] and q.nack([m], delay=0) == 1
    got = q.pop(2)
    assert [x.payload for x in got] == ["a", "c0"]
    st = q.stats()
    assert (st.ready, st.failed, st.extra["expired"], st.extra["expired_pending"]) == (2, 1, 1, 0)
    rest = drain(q)
    assert checksum([x.payload for x in got] + rest) == checksum(["a", "c0", "c1", "d"]) and len(rest) == 2
    assert [(f.id, f.payload, f.last_error) for f in q.list_failed()] == [(b[0], "b", "expired")]
    assert len(c) == 2 and len(d) == 1


def test_the_cli_on_a_rows_ring_with_a_ttl(dbq: DbQueue, capsys: pytest.CaptureFixture[str]) -> None:
    """Through dbqueue's main(): create a rows ring with --ttl and --on-expiry, push with a push's own
    --ttl, stats with the expiry counts, pop, the failed list with last_error "expired", requeue."""
    import json

    from airflow_dbqueue import cli

    base = ["--dsn", dbq.db.dsn, "--schema", dbq.schema]
    create = ["create", "r", "--design", "ring", "--layout", "rows", "--capacity", "64", "--lanes", "1"]
    assert cli.main([*base, *create, "--ttl", "3600", "--on-expiry", "fail"]) == 0
    capsys.readouterr()
    q = dbq.queue("r")
    assert (q.settings.ttl_s, q.settings.on_expiry) == (3600.0, OnExpiry.FAIL)
    assert cli.main([*base, "push", "r", '{"n": 1}', '{"n": 2}', "--ttl", "60"]) == 0
    doomed = json.loads(capsys.readouterr().out)["ids"]
    assert cli.main([*base, "push", "r", '{"n": 3}']) == 0
    live = json.loads(capsys.readouterr().out)["ids"]
    _age_rows(dbq, q, doomed, -1.0)
    assert cli.main([*base, "stats", "r"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["ready"], st["failed"], st["expired"], st["expired_pending"]) == (1, 0, 0, 2)
    assert cli.main([*base, "pop", "r", "-n", "10"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(m["id"], m["payload"]) for m in out] == [(live[0], {"n": 3})]
    assert cli.main([*base, "failed", "r"]) == 0
    failed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(f["id"], f["payload"], f["error"]) for f in failed] == [
        (doomed[0], {"n": 1}, "expired"),
        (doomed[1], {"n": 2}, "expired"),
    ]
    assert cli.main([*base, "stats", "r"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["ready"], st["failed"], st["expired"], st["expired_pending"]) == (0, 2, 2, 0)
    assert cli.main([*base, "failed", "r", "--requeue"]) == 0
    assert json.loads(capsys.readouterr().out) == {"requeued": 2}
    again = drain(q)
    assert checksum(again) == checksum([{"n": 1}, {"n": 2}]) and q.list_failed() == []
