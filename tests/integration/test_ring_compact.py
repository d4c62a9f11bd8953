"""A ring's tables after a held xmin horizon, on a real PostgreSQL: they grow while a transaction keeps
old row versions alive and keep that size after it ends; Maintenance.compact_rings rewrites them back
(VACUUM FULL) without losing or changing a message, not while a transaction still holds the horizon,
and gives up on its lock after its lock timeout. Every test counts and checksums the messages."""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue.engine import ConfigurationError, DbQueue, MaintenanceConfig
from airflow_dbqueue.engine.dialects.postgres.maintenance import ring_slots_laid_out_bytes
from tests.dialects import run_sql
from tests.helpers import checksum, held_horizon, release_horizon
from tests.integration.test_conformance import drain

if TYPE_CHECKING:
    from airflow_dbqueue.engine.ring import RingQueue

pytestmark = pytest.mark.integration

SLOT_BYTES = 300


def relation_size(dbq: DbQueue, table: str) -> int:
    [(size,)] = run_sql(dbq, f"SELECT pg_relation_size('{{schema}}.{table}')")
    return int(size)


def payloads(rnd: random.Random, n: int) -> list[bytes]:
    """Payloads of 150 to SLOT_BYTES bytes, each different (a fixed one would compress the WAL)."""
    return [rnd.randbytes(rnd.randint(150, SLOT_BYTES)) for _ in range(n)]


def make_ring(dbq: DbQueue, name: str = "events", capacity: int = 2048) -> RingQueue:
    q = dbq.create_queue(
        name,
        design="ring",
        layout="slots",
        capacity=capacity,
        max_payload_bytes=SLOT_BYTES,
        payload_type="bytes",
        lanes=2,
    )
    return q  # type: ignore[return-value]


def bsum(items: Any) -> str:
    """The checksum of a multiset of bytes payloads."""
    return checksum(bytes(p).hex() for p in items)


def churn(q: RingQueue, rnd: random.Random, messages: int) -> tuple[int, str, str]:
    """Push and pop ``messages`` in batches; (count, checksum pushed, checksum popped)."""
    sent: list[bytes] = []
    got: list[Any] = []
    while len(sent) < messages:
        batch = payloads(rnd, 200)
        q.push_batch(batch)
        sent += batch
        got += [m.payload for m in q.pop(200)]
    got += [m.payload for m in drain(q)]
    assert len(got) == len(sent)
    return len(sent), bsum(sent), bsum(got)


def test_the_laid_out_size_is_that_of_rings_made_by_create_queue(dbq: DbQueue) -> None:
    """The estimate compact_rings compares against, for the slot sizes a ring may have."""
    for slot_bytes in (100, 300, 512, 1000, 4000):
        before = relation_size(dbq, "ring_slots")
        dbq.create_queue(
            f"r{slot_bytes}", design="ring", layout="slots", capacity=2048, max_payload_bytes=slot_bytes
        )
        made = relation_size(dbq, "ring_slots") - before
        estimate = ring_slots_laid_out_bytes(2048, slot_bytes)
        assert abs(made - estimate) <= 0.06 * made, (slot_bytes, made, estimate)


def test_a_ring_grown_under_a_held_horizon_is_compacted_after_it_and_keeps_its_messages(
    dbq: DbQueue, pg_dsn: str
) -> None:
    rnd = random.Random(7)
    q = make_ring(dbq)
    laid_out = relation_size(dbq, "ring_slots")
    m = dbq.maintenance()
    assert m.compact_rings(compact_min_bytes=0)["actions"] == [], "a ring at its laid-out size is left alone"
    conn = held_horizon(pg_dsn)
    try:
        n, sent, got = churn(q, rnd, 12 * 2048)
        assert sent == got
        kept = payloads(rnd, 1500)
        assert len(q.push_batch(kept)) == 1500
        grown = relation_size(dbq, "ring_slots")
        assert grown >= 2 * laid_out, (laid_out, grown)
        # While the transaction is open the rewrite would keep every version it may see: not run.
        held = m.compact_rings(compact_min_bytes=0, compact_horizon_min_age=0)
        [skip] = [a for a in held["actions"] if a["table"] == "ring_slots"]
        assert (skip["action"], skip["ok"], skip["bytes_after"]) == ("skip", False, None)
        assert "hold the xmin horizon" in skip["error"] and "report-job" in skip["error"]
        assert relation_size(dbq, "ring_slots") == grown
        report = dbq.maintain(
            MaintenanceConfig(compact_min_bytes=0, horizon_min_age_s=0, reindex=False, archive_after_s=0)
        )
        assert {"step": "compact", "object": "ring_slots", "action": "skip"}.items() <= next(
            i for i in report["incomplete"] if i["object"] == "ring_slots"
        ).items()
    finally:
        release_horizon(conn, pg_dsn)
    m.vacuum()
    assert relation_size(dbq, "ring_slots") == grown, "VACUUM frees the pages for reuse, it keeps them"
    done = m.compact_rings(compact_min_bytes=0, compact_horizon_min_age=0)
    [act] = [a for a in done["actions"] if a["table"] == "ring_slots"]
    assert (act["action"], act["ok"], act["bytes_before"]) == ("compact", True, grown), act
    after = relation_size(dbq, "ring_slots")
    assert act["bytes_after"] == after <= laid_out, (laid_out, grown, act)
    assert act["expected_bytes"] == ring_slots_laid_out_bytes(2048, SLOT_BYTES)
    # Every message waiting in the ring is there, once, unchanged; the ring goes on working.
    assert bsum(m.payload for m in drain(q)) == bsum(kept)
    n, sent, got = churn(q, rnd, 4 * 2048)
    assert sent == got and n >= 4 * 2048
    assert m.compact_rings()["actions"] == [], "back at its size: nothing to do"


def test_a_compaction_gives_up_waiting_for_its_lock_and_changes_nothing(dbq: DbQueue, pg_dsn: str) -> None:
    rnd = random.Random(8)
    q = make_ring(dbq)
    kept = payloads(rnd, 300)
    q.push_batch(kept)
    with psycopg.connect(pg_dsn) as other:  # a transaction that pushed and has not committed yet
        other.execute(f'LOCK TABLE "{dbq.schema}".ring_slots IN ROW EXCLUSIVE MODE')
        t0 = time.monotonic()
        out = dbq.maintenance().compact_rings(
            only=["ring_slots"], compact_lock_timeout=0.5, compact_horizon_min_age=60
        )
        took = time.monotonic() - t0
        other.rollback()
    [act] = out["actions"]
    assert (act["table"], act["action"], act["ok"]) == ("ring_slots", "compact", False), act
    assert "gave up waiting 0.5s for its lock" in act["error"]
    assert took < 10
    assert bsum(m.payload for m in drain(q)) == bsum(kept)


def test_pushes_and_pops_go_on_through_a_compaction(dbq: DbQueue, pg_dsn: str) -> None:
    """Two producers and two consumers (each with its own client) run while the ring's tables are
    rewritten three times: they wait for the rewrite (a pop may come back empty), and every message
    comes out once, unchanged."""
    q = make_ring(dbq, capacity=1024)
    m = dbq.maintenance()
    stop = threading.Event()
    sent: list[list[bytes]] = [[], []]
    got: list[list[bytes]] = [[], []]
    errors: list[BaseException] = []

    def produce(k: int) -> None:
        rnd = random.Random(k)
        with DbQueue(pg_dsn, schema=dbq.schema) as client:
            handle = client.queue("events")
            handle.push_timeout = 30.0
            try:
                while not stop.is_set():
                    batch = payloads(rnd, 50)
                    handle.push_batch(batch)
                    sent[k] += batch
            except BaseException as exc:
                errors.append(exc)

    def consume(k: int) -> None:
        with DbQueue(pg_dsn, schema=dbq.schema) as client:
            handle = client.queue("events")
            try:
                while not stop.is_set():
                    got[k] += [msg.payload for msg in handle.pop(100)]
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=f, args=(k,)) for f in (produce, consume) for k in (0, 1)]
    for t in threads:
        t.start()
    actions = []
    try:
        for _ in range(3):
            time.sleep(0.7)
            actions += m.compact_rings(only=["ring_slots", "ring_lanes"], compact_horizon_min_age=60)[
                "actions"
            ]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert [a["table"] for a in actions if a["ok"]], actions
    rest = [msg.payload for msg in drain(q)]
    pushed = sent[0] + sent[1]
    popped = got[0] + got[1] + rest
    assert len(popped) == len(pushed) > 0
    assert bsum(popped) == bsum(pushed)


def test_bad_settings_are_refused(dbq: DbQueue) -> None:
    m = dbq.maintenance()
    with pytest.raises(ConfigurationError, match="ring tables"):
        m.compact_rings(only=["meta"])
    with pytest.raises(ConfigurationError, match="bloat_ratio"):
        m.compact_rings(compact_bloat_ratio=0.5)
    with pytest.raises(ConfigurationError, match="compact_lock_timeout"):
        m.compact_rings(compact_lock_timeout=float("nan"))
    with pytest.raises(ConfigurationError, match="compact_bloat_ratio"):
        MaintenanceConfig(compact_bloat_ratio=float("inf"))
