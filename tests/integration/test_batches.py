"""Batches: claimed together under one lease and one id, read by id elsewhere, acked or released whole.

Every test runs on each design (:data:`DESIGNS`): the table design, a ring, a ring's consumer group
besides its default one, whose batches must behave as a queue's of its own, a ring of the rows layout,
and such a ring's group besides its default one (its ledger is its own copy)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import (
    BatchNotFoundError,
    BatchState,
    BatchStateError,
    ConfigurationError,
    DbQueue,
    LeaseExpiredError,
    Queue,
    Semantics,
)
from tests.helpers import checksum

pytestmark = pytest.mark.integration

DESIGNS = ["table", "ring", "ring-group", "ring-rows", "ring-rows.group"]


@pytest.fixture(params=DESIGNS)
def make_queue(request: pytest.FixtureRequest, dbq: DbQueue) -> Callable[..., Queue]:
    """``make(name, **settings)``: a queue of the design, the handle of a ring's group ``g`` (added
    before anything is pushed, so it sees every message the test pushes), a ring of the rows layout, or
    the handle of such a ring's group ``g``."""
    design, _, variant = str(request.param).partition("-")
    layout = {"layout": "rows"} if variant.startswith("rows") else {}

    def make(name: str, **settings: Any) -> Queue:
        q = dbq.create_queue(name, design=design, **layout, **settings)
        return q.add_group("g") if variant.endswith("group") else q  # type: ignore[attr-defined, no-any-return]

    return make


def finished(q: Queue, n: int) -> None:
    """Assert that ``n`` messages are finished and none is left: counted as finished on the table
    design; on a ring, which keeps no finished messages, as nothing ready, in flight or failed."""
    st = q.stats(exact=True)
    if q.settings.design == "table":
        assert st.finished == n, st
    assert (st.ready, st.in_flight, st.failed) == (0, 0, 0), st


def _read(pg_dsn: str, query: str) -> list[tuple[Any, ...]]:
    """Run a batch query the way a foreign reader (Spark's JDBC source) does: as plain text."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        return c.execute(query.encode()).fetchall()


def test_claim_read_ack(make_queue: Callable[..., Queue], pg_dsn: str) -> None:
    q = make_queue("orders")
    sent = [{"order": i, "amount": i * 3} for i in range(250)]
    q.push_batch(sent)
    batch = q.claim_batch(100, visibility_timeout=60)
    assert batch is not None and batch.size == 100 and batch.state is BatchState.CLAIMED
    assert q.stats().in_flight == 100 and q.stats().ready == 150
    rows = _read(pg_dsn, q.batch_query(batch.batch_id))
    assert [r[0] for r in rows] == list(range(1, 101))  # ord numbers the claim order
    assert [(r[1], r[2]) for r in rows] == list(batch.receipts)
    got = [json.loads(bytes(r[3])) for r in rows]
    assert got == sent[:100]  # FIFO within one priority
    # as Spark's JDBC source reads it in two partitions on ord: the query as a subquery, filtered
    parts = [
        _read(
            pg_dsn,
            f'SELECT "ord","id","delivery","payload" FROM ({q.batch_query(batch.batch_id)}) AS batch '
            + where,
        )
        for where in ('WHERE "ord" < 51 or "ord" is null', 'WHERE "ord" >= 51')
    ]
    assert [len(p) for p in parts] == [50, 50] and sorted(parts[0] + parts[1]) == sorted(rows)
    assert q.ack_batch(batch.batch_id) == 100
    assert q.ack_batch(batch.batch_id) == 0  # idempotent
    assert q.get_batch(batch.batch_id).state is BatchState.ACKED
    st = q.stats()
    assert (st.in_flight, st.ready) == (0, 150)
    if q.settings.design == "table":
        assert st.finished == 100
    rest = q.pop(200)
    assert checksum(got + [m.payload for m in rest]) == checksum(sent)


def test_every_message_once_across_batches(make_queue: Callable[..., Queue], pg_dsn: str) -> None:
    """Four threads claim batches concurrently; reading every batch by id yields each message once."""
    q = make_queue("orders")
    sent = [{"order": i} for i in range(2000)]
    q.push_batch(sent)
    read: list[Any] = []
    lock = threading.Lock()

    def worker() -> None:
        while (b := q.claim_batch(97)) is not None:
            rows = _read(pg_dsn, q.batch_query(b.batch_id))
            with lock:
                read.extend(json.loads(bytes(r[3])) for r in rows)
            q.ack_batch(b.batch_id)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(read) == len(sent) and checksum(read) == checksum(sent)
    finished(q, len(sent))


def test_release_gives_the_batch_back_and_counts_attempts(make_queue: Callable[..., Queue]) -> None:
    q = make_queue("orders", max_attempts=2)
    sent = [{"n": i} for i in range(10)]
    q.push_batch(sent)
    b1 = q.claim_batch(10)
    assert b1 is not None
    assert q.release_batch(b1.batch_id, delay=0, error="spark exit 1") == 10
    assert q.release_batch(b1.batch_id) == 0  # idempotent
    rel = q.get_batch(b1.batch_id)
    assert rel.state is BatchState.RELEASED and rel.last_error == "spark exit 1"
    with pytest.raises(BatchStateError, match="released"):
        q.ack_batch(b1.batch_id)
    assert q.open_batches() == []
    b2 = q.claim_batch(10)
    assert b2 is not None and b2.batch_id != b1.batch_id
    assert [b.batch_id for b in q.open_batches()] == [b2.batch_id]
    assert sorted(i for i, _ in b2.receipts) == sorted(i for i, _ in b1.receipts)
    assert all(d == 2 for _, d in b2.receipts)
    q.release_batch(b2.batch_id, delay=0)  # second attempt of max 2: failed
    st = q.stats()
    assert (st.ready, st.failed) == (0, 10)
    assert checksum([f.payload for f in q.list_failed()]) == checksum(sent)


def test_ack_with_a_lost_lease_acks_nothing(make_queue: Callable[..., Queue]) -> None:
    q = make_queue("orders", visibility_timeout=0.3)
    q.push_batch([{"n": i} for i in range(5)])
    b = q.claim_batch(5)
    assert b is not None
    time.sleep(0.5)
    assert q.reclaim_expired() == 5
    # someone else has one of them now, under a lease of its own long enough to outlast the checks
    # below on a loaded machine (at load 15 to 20 the queue's 0.3 s ran out before its ack)
    [again] = q.pop(1, semantics=Semantics.AT_LEAST_ONCE, visibility_timeout=60)
    with pytest.raises(LeaseExpiredError):
        q.ack_batch(b.batch_id)
    assert q.get_batch(b.batch_id).state is BatchState.CLAIMED
    st = q.stats()
    assert (st.ready, st.in_flight, st.finished) == (4, 1, 0)
    # releasing it afterwards gives back nothing it no longer holds
    assert q.release_batch(b.batch_id, delay=0) == 0
    assert q.ack([again]) == 1


def test_ack_of_an_expired_batch_is_refused_before_any_reclaim(make_queue: Callable[..., Queue]) -> None:
    """A batch whose lease ran out is refused at ack with LeaseExpiredError even while nobody has
    reclaimed its messages yet; nothing is acked, and its messages come back."""
    q = make_queue("orders", visibility_timeout=0.2)
    sent = [{"n": i} for i in range(4)]
    q.push_batch(sent)
    b = q.claim_batch(4)
    assert b is not None
    time.sleep(0.4)
    with pytest.raises(LeaseExpiredError):
        q.ack_batch(b.batch_id)
    assert q.get_batch(b.batch_id).state is BatchState.CLAIMED
    again = q.pop(10, semantics=Semantics.AT_LEAST_ONCE)
    assert checksum([m.payload for m in again]) == checksum(sent)
    assert q.ack(again) == 4


def test_ack_in_the_callers_transaction_rolls_back_with_it(
    make_queue: Callable[..., Queue], dbq: DbQueue
) -> None:
    q = make_queue("orders")
    q.push_batch([{"n": i} for i in range(3)])
    b = q.claim_batch(3)
    assert b is not None
    with pytest.raises(RuntimeError), dbq.transaction() as conn:
        assert q.ack_batch(b.batch_id, conn=conn) == 3
        raise RuntimeError("results failed to commit")
    assert q.get_batch(b.batch_id).state is BatchState.CLAIMED
    assert q.stats().in_flight == 3
    with dbq.transaction() as conn:
        q.ack_batch(b.batch_id, conn=conn)
    finished(q, 3)


def test_extend_keeps_the_claim(make_queue: Callable[..., Queue]) -> None:
    q = make_queue("orders", visibility_timeout=0.4)
    q.push_batch([{"n": i} for i in range(4)])
    b = q.claim_batch(4)
    assert b is not None
    until = q.extend_batch(b.batch_id, 30)
    assert until > b.lease_until and q.get_batch(b.batch_id).lease_until == until
    time.sleep(0.6)
    assert q.reclaim_expired() == 0
    assert q.ack_batch(b.batch_id) == 4
    with pytest.raises(BatchStateError, match="acked"):
        q.extend_batch(b.batch_id, 30)


def test_extend_after_expiry_raises(make_queue: Callable[..., Queue]) -> None:
    q = make_queue("orders", visibility_timeout=0.2)
    q.push_batch([{"n": 1}])
    b = q.claim_batch(1)
    assert b is not None
    time.sleep(0.4)
    with pytest.raises(LeaseExpiredError):
        q.extend_batch(b.batch_id, 30)


def test_empty_queue_claims_nothing_and_bad_ids_are_named(make_queue: Callable[..., Queue]) -> None:
    q = make_queue("orders")
    assert q.claim_batch(10) is None
    with pytest.raises(BatchNotFoundError, match="orders"):
        q.get_batch(str(uuid.uuid4()))
    with pytest.raises(ConfigurationError, match="UUID"):
        q.batch_query("1; DROP TABLE x")
    with pytest.raises(ConfigurationError, match="batch size"):
        q.claim_batch(0)


def test_drop_queue_drops_its_batches(make_queue: Callable[..., Queue], dbq: DbQueue, pg_dsn: str) -> None:
    """The ledger rows of a dropped queue's batches go with it: the schema's batches table's, or a ring of
    the rows layout's (or its group's) own ledger table (dropped with the ring)."""
    q = make_queue("orders")
    q.push_batch([{"n": 1}, {"n": 2}])
    b = q.claim_batch(2)
    assert b is not None
    ledger = q._own() + "b" if q.settings.layout == "rows" else "batches"  # type: ignore[attr-defined]

    def claims() -> int | None:
        with psycopg.connect(pg_dsn) as c:
            if c.execute("SELECT to_regclass(%s)", [f'"{dbq.schema}"."{ledger}"']).fetchone() == (None,):
                return None
            row = c.execute(f'SELECT count(*) FROM "{dbq.schema}"."{ledger}"').fetchone()
        return None if row is None else int(row[0])

    assert claims() == 1
    dbq.drop_queue("orders")
    assert claims() == (None if ledger != "batches" else 0)


def test_upkeep_forgets_old_finished_batches_only(make_queue: Callable[..., Queue]) -> None:
    q = make_queue("orders")
    q.push_batch([{"n": i} for i in range(6)])
    acked, released, still_open = q.claim_batch(2), q.claim_batch(2), q.claim_batch(2)
    assert acked is not None and released is not None and still_open is not None
    q.ack_batch(acked.batch_id)
    q.release_batch(released.batch_id, delay=60)
    assert q.maintain()["batches_purged"] == 0  # a week's retention by default
    q.batch_retention_s = 0  # type: ignore[attr-defined]
    time.sleep(0.01)
    report = q.maintain()
    assert (report["reclaimed"], report["batches_purged"]) == (0, 2)
    assert [b.batch_id for b in q.open_batches()] == [still_open.batch_id]
    with pytest.raises(BatchNotFoundError):
        q.get_batch(acked.batch_id)


def test_open_batches_of_a_consumer_prefix(make_queue: Callable[..., Queue]) -> None:
    """A task's earlier tries' batches are found by the prefix of their consumer, whatever other
    consumers hold; LIKE's wildcards in a prefix are plain characters."""
    q = make_queue("orders")
    q.push_batch([{"n": i} for i in range(8)])
    mine = q.claim_batch(2, consumer="dag_a.t.run_1.-1.try1")
    other = q.claim_batch(2, consumer="dagXa.t.run_1.-1.try1")  # '_' of the prefix must not match 'X'
    later = q.claim_batch(2, consumer="dag_a.t.run_1.-1.try2")
    done = q.claim_batch(2, consumer="dag_a.t.run_1.-1.try1")
    assert mine is not None and other is not None and later is not None and done is not None
    q.ack_batch(done.batch_id)
    found = q.open_batches(consumer_prefix="dag_a.t.run_1.-1.try")
    assert [b.batch_id for b in found] == [mine.batch_id, later.batch_id]
    assert [b.batch_id for b in q.open_batches(consumer_prefix="dag_a.t.run_1.-1.try2")] == [later.batch_id]
    assert q.open_batches(consumer_prefix="dag_b.") == []
    assert len(q.open_batches()) == 3
