"""Message expiry (table design): a message not popped within its time to live is never delivered; it
goes to the failed state with last_error "expired" (listed, counted, requeued) or is dropped
(on_expiry="drop"), by the sweep of the pops (a queue with a ttl) or of the upkeep.

Every test counts what went in and what came out, and compares checksums of the payloads.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

from airflow_dbqueue.engine.errors import ConfigurationError, NotSupportedError
from airflow_dbqueue.engine.models import OnExpiry
from tests.dialects import run_sql
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
    with pytest.raises(ConfigurationError, match="ttl applies to table queues only"):
        dbq.create_queue("w", design="ring", ttl=10)
    with pytest.raises(ConfigurationError, match="on_expiry='drop' applies to table queues only"):
        dbq.create_queue("w", design="ring", on_expiry="drop")
    r = dbq.create_queue("r", design="ring", capacity=16)
    with pytest.raises(NotSupportedError, match="ttl"):
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
