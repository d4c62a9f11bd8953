"""Maintenance beside drop_queue: a queue dropped while a run goes on is skipped with a note, never a
failed run, and dropping a queue while its finished messages are archived leaves no orphan row.

Each test runs on PostgreSQL, and on SQL Server when ``$DBQUEUE_TEST_MSSQL_DSN`` names one (skipped
otherwise; never run yet), but for the one that holds an archiver batch open by hand (PostgreSQL's).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue, MaintenanceConfig, QueueNotFoundError
from tests.dialects import dialect_dbq, postgres_only, run_sql  # noqa: F401 - dialect_dbq is the fixture "dbq"
from tests.helpers import checksum

pytestmark = pytest.mark.integration

FAST = MaintenanceConfig(archive_after_s=0, archive_retention_s=None, pause_s=0, reindex=False)
"""A run as `dbqueue maintain --archive-after 0` makes it, without index rebuilds (nothing is bloated)."""


TABLES = ("meta", "done", "archive", "batches", "rings", "ring_slots", "ring_failed")


def orphans(dbq: DbQueue) -> dict[str, int]:
    """Rows of queues that no longer exist, table by table (and payloads without a message)."""
    out = {}
    for table in TABLES:
        [(n,)] = run_sql(
            dbq,
            f"SELECT count(*) FROM {{schema}}.{table} t "
            "WHERE NOT EXISTS (SELECT 1 FROM {schema}.queues q WHERE q.queue_id = t.queue_id)",
        )
        out[table] = int(n)
    [(n,)] = run_sql(
        dbq,
        "SELECT count(*) FROM {schema}.data d "
        "WHERE NOT EXISTS (SELECT 1 FROM {schema}.meta m WHERE m.id = d.id) "
        "AND NOT EXISTS (SELECT 1 FROM {schema}.done f WHERE f.id = d.id)",
    )
    out["data"] = int(n)
    return out


NO_ORPHANS = dict.fromkeys((*TABLES, "data"), 0)


def test_queues_dropped_under_a_maintenance_client_are_skipped_with_a_note(dbq: DbQueue) -> None:
    """The maintenance client holds handles of a ring and a table queue (from an earlier run); another
    client drops both. The next runs, of every queue and of those named, skip them and say so."""
    dbq.create_queue("stream", design="ring", capacity=16).push_batch([1, 2, 3])
    dbq.create_queue("orders").push_batch([{"n": 1}])
    dbq.create_queue("kept").push_batch([{"n": 2}])
    with DbQueue(dbq.db.dsn, schema=dbq.schema, dialect=dbq.dialect) as m:
        first = m.maintain(FAST)
        assert first["notes"] == [] and set(first["upkeep"]) == {"stream", "orders", "kept"}
        dbq.drop_queue("stream")
        dbq.drop_queue("orders")
        named = m.maintain(dataclasses.replace(FAST, queues=("stream", "orders", "kept")))
        assert set(named["upkeep"]) == {"kept"} and set(named["metrics"]["queues"]) == {"kept"}
        for name in ("stream", "orders"):
            assert any(f"queue {name!r} no longer exists" in n for n in named["notes"]), named["notes"]
        every = m.maintain(FAST)
        assert set(every["upkeep"]) == {"kept"} and every["notes"] == []
        assert m.maintenance().metrics()["queues"].keys() == {"kept"}
        with pytest.raises(QueueNotFoundError):
            m.queue("stream")  # the stale handle was forgotten
    assert orphans(dbq) == NO_ORPHANS


def test_maintenance_beside_a_loop_creating_using_and_dropping_queues(dbq: DbQueue) -> None:  # noqa: PLR0915
    """What the issue saw fail 21 times in 22: `maintain --archive-after 0` in a loop while other clients
    create, use and drop queues (both designs). No run may fail; afterwards no row of a dropped queue is
    left anywhere, and the queue that lived through it all has every message it was given, archived
    once, with its payloads (counts and checksums).

    Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around.
    """
    main = dbq.create_queue("main")
    sent: list[Any] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    reports: list[dict[str, Any]] = []
    drops: list[int] = []

    def churn(who: str) -> None:
        with DbQueue(dbq.db.dsn, schema=dbq.schema, dialect=dbq.dialect, pool_size=2) as c:
            i = 0
            try:
                while not stop.is_set():
                    ring = i % 3 == 2
                    design, capacity = ("ring", 32) if ring else ("table", None)
                    q = c.create_queue(f"side_{who}_{i}", design=design, capacity=capacity)
                    q.push_batch([{"side": i, "k": k} for k in range(20)])
                    q.pop(15)  # at most once: finished rows for the archiver (table design)
                    if not ring:
                        leased = q.pop(3, semantics="at-least-once")
                        q.ack(leased[:2])
                        q.claim_batch(1)
                    c.drop_queue(f"side_{who}_{i}")
                    drops.append(i)
                    i += 1
            except BaseException as exc:
                errors.append(exc)

    def work() -> None:
        with DbQueue(dbq.db.dsn, schema=dbq.schema, dialect=dbq.dialect, pool_size=2) as c:
            q = c.queue("main")
            try:
                for r in range(40):
                    payloads = [{"main": r, "k": k} for k in range(25)]
                    q.push_batch(payloads)
                    sent.extend(payloads)
                    got = q.pop(25, semantics="at-least-once")
                    q.ack(got)
            except BaseException as exc:
                errors.append(exc)

    def maintain() -> None:
        with DbQueue(dbq.db.dsn, schema=dbq.schema, dialect=dbq.dialect, pool_size=2) as m:
            try:
                while not stop.is_set():
                    reports.append(m.maintain(FAST))
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=churn, args=(who,)) for who in "ab"]
    threads += [threading.Thread(target=maintain) for _ in range(2)]
    worker = threading.Thread(target=work)
    for t in [*threads, worker]:
        t.start()
    worker.join(timeout=300)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not errors:  # enough drops beside enough complete runs
        if len(drops) >= 100 and sum(r["skipped"] is None for r in reports) >= 20:
            break
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(drops) >= 100 and sum(r["skipped"] is None for r in reports) >= 20, (len(drops), len(reports))
    assert all(r["skipped"] is None or "holds the lock" in r["skipped"] for r in reports)
    final = dbq.maintain(FAST)
    assert final["skipped"] is None and final["notes"] == []
    assert [q.name for q in dbq.list_queues()] == ["main"]
    assert orphans(dbq) == NO_ORPHANS
    rows = run_sql(
        dbq, "SELECT payload FROM {schema}.archive WHERE queue_id = %(q)s", {"q": main.settings.queue_id}
    )
    archived = [json.loads(bytes(r[0])) for r in rows]
    assert len(archived) == len(sent) == 1000
    assert checksum(archived) == checksum(sent)
    assert main.stats().ready == main.stats().in_flight == main.stats().finished == 0


def test_a_drop_waits_for_an_archiver_batch_holding_its_rows(dbq: DbQueue) -> None:
    """An archiver batch has taken a dropped queue's finished messages and not committed yet; the drop
    waits for it and then deletes what it archived: no archive row is left for the dropped queue."""
    postgres_only(dbq, "holds an archiver batch open on a psycopg connection")
    q = dbq.create_queue("orders")
    q.push_batch([{"n": i} for i in range(30)])
    assert len(q.pop(30)) == 30  # finished, in done
    dropped = threading.Event()
    with psycopg.connect(dbq.db.dsn) as archiver:
        taken, moved = archiver.execute(
            dbq.db.query("archive_batch"),  # type: ignore[attr-defined]
            {"older_than_s": 0.0, "n": 1000, "all_queues": True, "queue_ids": []},
        ).fetchone()  # type: ignore[misc]
        assert (taken, moved) == (30, 30)
        t = threading.Thread(target=lambda: (dbq.drop_queue("orders"), dropped.set()))
        t.start()
        time.sleep(0.5)
        assert not dropped.is_set(), "the drop did not wait for the archiver batch holding its rows"
        archiver.commit()
    t.join(timeout=30)
    assert dropped.is_set()
    assert orphans(dbq) == NO_ORPHANS


def test_finished_rows_of_a_queue_dropped_by_an_older_version_are_not_archived(dbq: DbQueue) -> None:
    """Rows an older version's drop could leave in done (for a queue id that is gone) are deleted with
    their payloads by the archiver and counted as discarded, never archived."""
    q = dbq.create_queue("orders")
    q.push_batch([{"n": i} for i in range(10)])
    q.pop(10)
    run_sql(dbq, "UPDATE {schema}.done SET queue_id = queue_id + 1000")  # as if its queue were gone
    result = dbq.maintenance().archive(archive_after=0)
    assert (result.rows, result.discarded) == (0, 10)
    assert orphans(dbq) == NO_ORPHANS
