"""Samples and what a held horizon costs, on a real PostgreSQL: maintenance records one sample a queue a
run with the depth and the pushes and pops since the last one (counted and checksummed against what the
test moved), its retention deletes old samples, and a run under a REPEATABLE READ transaction names it
with the dead rows its VACUUM could not remove; once it ends, the next run reports neither."""

from __future__ import annotations

import itertools
import threading
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
    """A ring of the rows layout is sampled with its depth, its totals (the default group's pops) and its
    groups' lag; and a whole maintenance run of a schema holding one completes."""
    q = dbq.create_queue("rows", design="ring", layout="rows", capacity=64)
    audit = q.add_group("audit", start="earliest")
    m = dbq.maintenance()
    m.sample()
    ledger = Ledger(q, "r")
    ledger.move(30, 20)  # the default group takes 20 of 30; the audit group takes 12
    taken = [x.payload for x in audit.pop(12)]
    assert checksum(taken) == checksum(ledger.pushed[:12])
    out = m.sample()
    assert out["queues"]["rows"] == {"pushed": 30, "popped": 20, "push_total": 30, "pop_total": 20}
    [first, second] = m.samples(window=600)["rows"]
    assert (first["ready"], second["ready"]) == (0, 10)
    assert first["groups"] == {"audit": 0} and second["groups"] == {"audit": 18}
    report = dbq.maintain(MaintenanceConfig(archive_after_s=0.0))
    assert report.get("incomplete") in (None, [], {}), report


def test_a_rows_rings_totals_count_through_rotations_of_a_ring_with_groups(dbq: DbQueue) -> None:
    """With a consumer group, segments are emptied by the rotation over every group: the ring's push total
    still counts every message, and each group's pop total what it finished."""
    q = dbq.create_queue("rows", design="ring", layout="rows", capacity=16, lanes=1)
    audit = q.add_group("audit")
    m = dbq.maintenance()
    m.sample()
    sent: list[Any] = []
    got: dict[str, list[Any]] = {"default": [], "audit": []}
    for i in range(40):  # 40 rows through a ring of 16: segments emptied 6 times or more
        batch = [{"i": i, "j": j} for j in range(1 + i % 3)]
        q.push_batch(batch)
        sent += batch
        got["default"] += [x.payload for x in q.pop(10)]
        if i % 4 == 3:
            got["audit"] += [x.payload for x in audit.pop(100)]
    assert checksum(got["default"]) == checksum(got["audit"]) == checksum(sent)
    assert max(q.stats().extra["segment_generations"]) >= 9
    out = m.sample()["queues"]["rows"]
    assert out == {"pushed": 79, "popped": 79, "push_total": 79, "pop_total": 79} and len(sent) == 79
    st = audit.stats().extra
    assert (st["push_total"], st["pop_total"], st["lag_messages"]) == (79, 79, 0)


def test_a_rows_rings_totals_never_go_back_while_it_pushes_pops_and_rotates(dbq: DbQueue) -> None:
    """Read while another thread pushes, pops at least once and acks through rotations (a ring of 16
    rows), a rows ring's totals never go back and its pop total never passes its push total: the push
    total and the lag are read in one snapshot, the emptied segments' total with the segments it
    replaces. At the end they are what went in and came out."""
    q = dbq.create_queue("rows", design="ring", layout="rows", capacity=16, lanes=1)
    sent: list[Any] = []
    acked: list[Any] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for i in range(200):
                batch = [{"i": i, "j": j} for j in range(1 + i % 3)]
                q.push_batch(batch)
                sent.extend(batch)
                got = q.pop(3, semantics="at-least-once")
                q.ack(got)
                acked.extend(x.payload for x in got)
            while got := q.pop(10, semantics="at-least-once"):
                q.ack(got)
                acked.extend(x.payload for x in got)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    reader = dbq.queue("rows")
    worker = threading.Thread(target=work)
    worker.start()
    seen = []
    while worker.is_alive():
        extra = reader.stats().extra
        seen.append((extra["push_total"], extra["pop_total"]))
    worker.join()
    assert errors == []
    extra = reader.stats().extra
    seen.append((extra["push_total"], extra["pop_total"]))
    assert checksum(acked) == checksum(sent) and len(sent) == 399
    assert seen[-1] == (399, 399) and len(seen) > 20
    assert max(reader.stats().extra["segment_generations"]) >= 40  # rotated about 50 times meanwhile
    assert all(popped <= pushed for pushed, popped in seen), seen
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in itertools.pairwise(seen)), seen


class _RolledBack(Exception):
    pass


def _take(q: Any, n: int) -> list[Any]:
    """``n`` messages popped at least once; while a lane waits at a gap (a push rolled back), maintain()
    gives it up."""
    got: list[Any] = []
    for _ in range(100):
        got += q.pop(n - len(got), semantics="at-least-once")
        if len(got) == n:
            return got
        q.maintain()
        time.sleep(0.06)
    raise AssertionError(f"took {len(got)} of {n}")


def _finish_all(q: Any, fail: set[int], finished: list[Any]) -> None:
    """Pop the ring dry at least once, acking each message but those of ``fail`` (nacked, their last
    attempt: failed), all of them appended to ``finished``; empty pops let maintain() give up gaps."""
    while True:
        got = q.pop(10, semantics="at-least-once")
        if not got:
            if q.stats().extra["lag_messages"] == 0:
                return
            q.maintain()
            time.sleep(0.06)
            continue
        for x in got:
            if x.id in fail:
                q.nack([x], error="no")
            else:
                q.ack([x])
            finished.append(x.payload)


def test_a_rows_rings_samples_count_its_pushes_and_pops_exactly_through_rotations(dbq: DbQueue) -> None:
    """A ring of the rows layout of 16 rows (segments of 4), sampled after each of four rounds of pushes
    of 1 to 7 messages and pops of each kind: each sample's pushed and popped are exactly the messages
    pushed and finished since the one before, while segments are emptied between samples (by pushes,
    and by maintain() every other round). Popped counts a message taken at most once, acked, or failed
    on its last attempt; one leased, or nacked to come again, is not popped until it is finished. A push
    rolled back counts nothing, and nor does its row, given up as a gap."""
    q = dbq.create_queue(
        "rows",
        design="ring",
        layout="rows",
        capacity=16,
        lanes=2,
        max_attempts=2,
        retry_backoff=0,
        retry_backoff_max=0,
    )
    m = dbq.maintenance()
    assert m.sample()["queues"]["rows"] == {"pushed": None, "popped": None, "push_total": 0, "pop_total": 0}
    pushed: list[Any] = []
    finished: list[Any] = []
    counts = []
    gens = [q.stats().extra["segment_generations"]]
    before = (0, 0)  # what was pushed and finished at the previous sample
    for rnd in range(4):
        for i in range(9):  # 9 rows a round: more than two segments
            batch = [{"r": rnd, "i": i, "j": j, "pad": "x" * j} for j in range(1 + (rnd + i) % 7)]
            if i == 4:  # a push rolled back: its row number is a gap
                with pytest.raises(_RolledBack), dbq.transaction() as conn:
                    q.push_batch(batch, conn=conn)
                    raise _RolledBack
                continue
            q.push_batch(batch)
            pushed += batch
            if i % 2:
                finished += [x.payload for x in q.pop(1 + len(batch) // 2)]  # at most once
        acked = _take(q, 3)
        q.ack(acked)
        finished += [x.payload for x in acked]
        held = _take(q, 2)  # in flight at the sample
        again = _take(q, 1)
        q.nack(again)  # ready again: not finished
        if rnd % 2:
            q.maintain()  # gives up the gap and rotates ahead
        counts.append(m.sample()["queues"]["rows"])
        since = (len(pushed) - before[0], len(finished) - before[1])
        assert (counts[-1]["pushed"], counts[-1]["popped"]) == since
        before = (len(pushed), len(finished))
        gens.append(q.stats().extra["segment_generations"])
        q.ack(held[:1])
        finished.append(held[0].payload)
        q.nack(held[1:])  # comes again, then acked
        _finish_all(q, {again[0].id}, finished)  # `again` fails on its second attempt
    final = m.sample()["queues"]["rows"]
    counts.append(final)
    assert checksum(finished) == checksum(pushed) and len(finished) == len(pushed) > 4 * 20
    assert sum(c["pushed"] for c in counts) == len(pushed) == final["push_total"]
    assert sum(c["popped"] for c in counts) == len(pushed) == final["pop_total"]
    assert len(q.list_failed()) == 4  # one a round
    # after the first lap, segments were emptied between each sample and the next
    assert max(gens[-1]) >= 8 and all(a != b for a, b in itertools.pairwise(gens[1:])), gens
    kept = m.samples(window=600)["rows"]
    assert [s["pushed"] for s in kept] == [None, *(c["pushed"] for c in counts)]
    assert [s["popped"] for s in kept] == [None, *(c["popped"] for c in counts)]
    st = q.stats()
    assert (st.ready, st.delayed, st.in_flight, st.failed) == (0, 0, 0, 4)


def test_uninstall_drops_the_samples_with_the_rest(pg_dsn: str, schema_name: str) -> None:
    with DbQueue(pg_dsn, schema=schema_name) as dbq:
        dbq.install()
        dbq.create_queue("orders")
        assert dbq.maintenance().sample()["recorded"] == 1
        dbq.uninstall()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        left = c.execute("SELECT to_regclass(%s)", [f'"{schema_name}".samples']).fetchone()
    assert left == (None,)
