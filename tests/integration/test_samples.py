"""Samples and what a held horizon costs, on a real PostgreSQL: maintenance records one sample a queue a
run with the depth and the pushes and pops since the last one (counted and checksummed against what the
test moved), its retention deletes old samples, and a run under a REPEATABLE READ transaction names it
with the dead rows its VACUUM could not remove; once it ends, the next run reports neither."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue, MaintenanceConfig
from tests.helpers import checksum, held_horizon

pytestmark = pytest.mark.integration

QUICK = {"reindex": False, "compact_rings": False, "archive_after_s": 3600.0}
"""A run that samples without rebuilding or compacting (and keeps finished messages in done)."""


class Ledger:
    """What a test pushed into one queue and popped from it, in order, to count and checksum."""

    def __init__(self, q: Any, tag: str) -> None:
        self.q, self.tag = q, tag
        self.pushed: list[Any] = []
        self.popped: list[Any] = []

    def move(self, n: int, take: int) -> None:
        """Push ``n`` payloads, then pop ``take`` messages (at most once)."""
        batch = [{"tag": self.tag, "n": len(self.pushed) + i, "pad": "x" * (i % 7)} for i in range(n)]
        self.q.push_batch(batch)
        self.pushed += batch
        want = len(self.popped) + take
        while len(self.popped) < want:
            got = self.q.pop(min(100, want - len(self.popped)))
            assert got, "the queue ran dry before the test took what it pushed"
            self.popped += [m.payload for m in got]
        # FIFO and nothing lost or changed: what came out is what went in first
        assert checksum(self.popped) == checksum(self.pushed[: len(self.popped)])


@pytest.mark.parametrize("design", ["table", "ring"])
def test_each_run_samples_each_queue_with_what_was_pushed_and_popped(dbq: DbQueue, design: str) -> None:
    shape: dict[str, Any] = {"archive": True} if design == "table" else {"layout": "slots"}
    q = dbq.create_queue("orders", design=design, **shape)
    other = dbq.create_queue("audit", design=design, **shape)
    orders, audit = Ledger(q, "a"), Ledger(other, "b")
    m = dbq.maintenance()
    first = m.run(MaintenanceConfig(**QUICK))
    assert first["samples"]["recorded"] == 2
    assert first["samples"]["queues"]["orders"]["pushed"] is None  # no sample before it to count from

    counts = []
    for (n, take), (n2, take2) in (((300, 120), (40, 40)), ((50, 230), (0, 0))):
        orders.move(n, take)
        audit.move(n2, take2)
        got = m.run(MaintenanceConfig(**QUICK))["samples"]["queues"]
        counts.append(got)
        assert (got["orders"]["pushed"], got["orders"]["popped"]) == (n, take)
        assert (got["audit"]["pushed"], got["audit"]["popped"]) == (n2, take2)
    assert sum(c["orders"]["pushed"] for c in counts) == len(orders.pushed) == 350
    assert sum(c["orders"]["popped"] for c in counts) == len(orders.popped) == 350

    kept = m.samples(window=3600)
    assert sorted(kept) == ["audit", "orders"]
    rows = kept["orders"]
    assert [s["ready"] for s in rows] == [0, 180, 0]
    assert [s["pushed"] for s in rows] == [None, 300, 50]
    assert [s["popped"] for s in rows] == [None, 120, 230]
    assert rows[0]["at"] < rows[1]["at"] < rows[2]["at"]
    assert rows[1]["oldest_age_s"] is not None and rows[2]["oldest_age_s"] is None
    if design == "ring":
        assert rows[2]["push_total"] - rows[0]["push_total"] == 350
        assert rows[2]["pop_total"] - rows[0]["pop_total"] == 350
    assert all(s["dead_rows"] is not None for s in rows)


def test_a_table_queue_that_does_not_archive_has_no_counts(dbq: DbQueue) -> None:
    q = dbq.create_queue("jobs", archive=False)
    m = dbq.maintenance()
    m.sample()
    Ledger(q, "d").move(20, 5)
    out = m.sample()
    assert out["queues"]["jobs"] == {"pushed": None, "popped": None, "push_total": None, "pop_total": None}
    assert [s["ready"] for s in m.samples(window=600)["jobs"]] == [0, 15]


def test_retention_deletes_old_samples_in_batches(dbq: DbQueue, pg_dsn: str, schema_name: str) -> None:
    dbq.create_queue("orders")
    m = dbq.maintenance()
    m.sample()
    with psycopg.connect(pg_dsn, autocommit=True) as c:  # age 25 samples by two days
        qid = c.execute(f'SELECT queue_id FROM "{schema_name}".queues WHERE name = %s', ["orders"]).fetchone()
        assert qid is not None
        c.execute(
            f'INSERT INTO "{schema_name}".samples (queue_id, taken_at, ready, delayed, in_flight, failed) '
            "SELECT %s, now() - interval '2 days' - make_interval(secs => g), 0, 0, 0, 0 "
            "FROM generate_series(1, 25) g",
            [qid[0]],
        )
    out = m.sample(samples_keep=86_400, batch_size=10)
    assert (out["recorded"], out["deleted"]) == (1, 25)
    assert len(m.samples(window=10 * 86_400)["orders"]) == 2  # the two of today


def test_a_run_reports_what_a_held_horizon_costs_and_the_next_one_clears(dbq: DbQueue, pg_dsn: str) -> None:
    q = dbq.create_queue("orders")
    # Without the table design's recycling, which would empty the popped messages' partition (and its
    # dead rows with it) despite the hold: what is left here is what VACUUM cannot remove.
    config = MaintenanceConfig(horizon_min_age_s=1, horizon_min_dead_rows=1000, recycle=False, **QUICK)
    dbq.maintain(config)
    conn = held_horizon(pg_dsn)
    pid = conn.info.backend_pid
    try:
        Ledger(q, "held").move(3000, 3000)  # every pop deletes its meta row: 3000 dead rows
        time.sleep(1.5)
        report = dbq.maintain(config)
    finally:
        conn.close()
    h = report["horizon"]
    assert h["held"] is True
    [named] = [x for x in h["holders"] if x["pid"] == pid]
    assert (named["kind"], named["name"], named["state"]) == (
        "transaction",
        "report-job",
        "idle in transaction",
    )
    assert named["age_s"] >= 1.0 and named["backend_age_s"] >= named["age_s"] and named["xid_age"] >= 1
    assert "pg_class" in named["query"]
    assert h["oldest"]["pid"] == pid
    meta = [t for t in h["not_removable"] if t["table"] == "meta"]
    assert meta and meta[0]["dead_rows"] >= 3000 and "dead rows not yet removable" in meta[0]["why"]
    assert h["tables"]["meta"]["dead_tuples"] >= 3000 and h["dead_rows"] >= 3000
    assert report["metrics"]["horizon"]["dead_rows"] >= 3000
    [sample] = [s for s in dbq.maintenance().samples(window=600)["orders"]][-1:]
    assert sample["dead_rows"] >= 3000 and sample["horizon_xid_age"] >= 1
    assert sample["horizon_age_s"] >= 1.0

    after = dbq.maintain(config)  # released: VACUUM removes them, nothing holds the horizon
    assert after["horizon"]["held"] is False and after["horizon"]["holders"] == []
    assert after["horizon"]["not_removable"] == []
    assert (after["horizon"]["tables"].get("meta") or {}).get("dead_tuples", 0) < 1000
    last = dbq.maintenance().samples(window=600)["orders"][-1]
    assert last["dead_rows"] < 1000 and last["horizon_age_s"] < sample["horizon_age_s"]


def test_a_ring_compaction_deferred_by_the_horizon_is_reported(dbq: DbQueue, pg_dsn: str) -> None:
    q = dbq.create_queue("stream", design="ring", layout="slots", capacity=64)  # compaction: slots only
    conn = held_horizon(pg_dsn)
    pid = conn.info.backend_pid
    try:
        ledger = Ledger(q, "ring")
        for _ in range(10):
            ledger.move(40, 40)
        time.sleep(1.5)
        report = dbq.maintain(
            MaintenanceConfig(
                horizon_min_age_s=1, reindex=False, compact_bloat_ratio=1.0, compact_min_bytes=0
            )
        )
    finally:
        conn.close()
    deferred = report["horizon"]["deferred"]
    assert deferred and all(d["step"] == "compact" and d["action"] == "skip" for d in deferred)
    assert all(f"pid {pid}" in d["why"] for d in deferred)
    assert report["horizon"]["held"] and [i["object"] for i in report["incomplete"]] == [
        d["object"] for d in deferred
    ]


def test_a_rings_consumer_groups_are_sampled_with_their_lag(dbq: DbQueue) -> None:
    q = dbq.create_queue("ticks", design="ring", layout="slots", capacity=64)
    audit = q.add_group("audit", on_lag="block", lag_timeout=600)
    m = dbq.maintenance()
    m.sample()
    ledger = Ledger(q, "g")
    ledger.move(30, 30)  # the default group takes all 30; the audit group takes 12 of them
    taken = [x.payload for x in audit.pop(12)]
    assert checksum(taken) == checksum(ledger.pushed[:12])
    out = m.sample()
    assert out["queues"]["ticks"]["pushed"] == 30 and out["queues"]["ticks"]["popped"] == 30
    [first, second] = m.samples(window=600)["ticks"]
    assert first["groups"] == {"audit": 0} and second["groups"] == {"audit": 18}


def test_a_rows_rings_groups_are_sampled_with_their_lag_and_maintenance_runs(dbq: DbQueue) -> None:
    """A ring of the rows layout counts no positions: its sample has no totals, as a table queue that
    does not archive, but its depth and its groups' lag; and a whole maintenance run of a schema holding
    one completes."""
    q = dbq.create_queue("rows", design="ring", layout="rows", capacity=64)
    audit = q.add_group("audit", start="earliest")
    m = dbq.maintenance()
    m.sample()
    ledger = Ledger(q, "r")
    ledger.move(30, 20)  # the default group takes 20 of 30; the audit group takes 12
    taken = [x.payload for x in audit.pop(12)]
    assert checksum(taken) == checksum(ledger.pushed[:12])
    out = m.sample()
    assert out["queues"]["rows"] == {"pushed": None, "popped": None, "push_total": None, "pop_total": None}
    [first, second] = m.samples(window=600)["rows"]
    assert (first["ready"], second["ready"]) == (0, 10)
    assert first["groups"] == {"audit": 0} and second["groups"] == {"audit": 18}
    report = dbq.maintain(MaintenanceConfig(archive_after_s=0.0))
    assert report.get("incomplete") in (None, [], {}), report


def test_uninstall_drops_the_samples_with_the_rest(pg_dsn: str, schema_name: str) -> None:
    with DbQueue(pg_dsn, schema=schema_name) as dbq:
        dbq.install()
        dbq.create_queue("orders")
        assert dbq.maintenance().sample()["recorded"] == 1
        dbq.uninstall()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        left = c.execute("SELECT to_regclass(%s)", [f'"{schema_name}".samples']).fetchone()
    assert left == (None,)
