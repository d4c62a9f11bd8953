"""Query plans that keep the hot path fast. These check plan shapes and settings, never timings.

Both guard regressions that the benchmark found: pops stuck on a generic plan built while the queue
was empty (sequential scans of meta and data), and acks that walked every leased message.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue

pytestmark = pytest.mark.integration


def plan_nodes(plan: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(node type, index name) of every node of an EXPLAIN (FORMAT JSON) plan."""
    out = [(plan["Node Type"], plan.get("Index Name"))]
    for child in plan.get("Plans", []):
        out += plan_nodes(child)
    return out


def test_pooled_connections_never_use_generic_plans(dbq: DbQueue) -> None:
    q = dbq.create_queue("empty_first")
    with dbq.db.connection() as c:
        for _ in range(8):  # more than psycopg's prepare threshold, on an empty queue
            assert q.pop(100, conn=c) == []
        assert c.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)
        q.push_batch(list(range(5000)))
        c.execute(f'ANALYZE "{dbq.schema}".meta')
        row = c.execute(
            b"EXPLAIN (FORMAT JSON) " + dbq.db.query("pop_take"),
            {"queue_id": q.settings.queue_id, "n": 100, "archive": True},
        ).fetchone()
    assert row is not None
    nodes = plan_nodes(row[0][0]["Plan"] if isinstance(row[0], list) else json.loads(row[0])[0]["Plan"])
    assert ("Seq Scan", None) not in nodes, nodes
    assert ("Index Scan", "meta_ready_idx") in nodes, nodes


def test_ack_probes_receipts_by_id_not_every_lease(dbq: DbQueue) -> None:
    q = dbq.create_queue("many_leases")
    q.push_batch(list(range(20000)))
    leased = q.pop(20000, semantics="at-least-once")
    # no ANALYZE here: statistics from when the queue was empty are what a busy queue often has
    with dbq.db.connection() as c:
        params = {
            "ids": [leased[0].id],
            "deliveries": [leased[0].delivery],
            "queue_id": q.settings.queue_id,
            "archive": True,
        }
        row = c.execute(b"EXPLAIN (FORMAT JSON) " + dbq.db.query("ack"), params).fetchone()
    assert row is not None
    nodes = plan_nodes(row[0][0]["Plan"])
    assert ("Index Scan", "meta_pkey") in nodes or ("Bitmap Index Scan", "meta_pkey") in nodes, nodes
    assert all(name != "meta_leased_idx" for _, name in nodes), nodes
    assert q.ack(leased[:1]) == 1
    assert q.ack(leased[1:]) == 19999


def _walks_data(plan: dict[str, Any]) -> list[str]:
    """Plan nodes that read the data table without probing it by key."""
    bad = []
    keyed = "Index Cond" in plan or "Tid Cond" in plan
    if plan.get("Relation Name") == "data" and (
        plan["Node Type"] == "Seq Scan" or ("Index" in plan["Node Type"] and not keyed)
    ):
        bad.append(f"{plan['Node Type']} {plan.get('Index Name')}")
    for child in plan.get("Plans", []):
        bad += _walks_data(child)
    return bad


def test_payloads_are_probed_by_id_even_with_empty_table_statistics(dbq: DbQueue) -> None:
    """A drained queue analyzed while empty (as autovacuum does) must not make pops walk data. The
    payloads are over 1900 bytes, so they live in data (smaller ones stay in their meta rows)."""
    q = dbq.create_queue("drained", archive=False)
    q.push_batch([f"{i}:" + "x" * 1950 for i in range(2000)])
    while q.pop(500):
        pass
    with dbq.db.connection() as c:
        c.execute(f'ANALYZE "{dbq.schema}".meta, "{dbq.schema}".data, "{dbq.schema}".done')
        q.push_batch([f"{i}:" + "x" * 1950 for i in range(20000)])
        qid = q.settings.queue_id
        cases = {
            "pop_lease": {"queue_id": qid, "n": 250, "visibility_timeout_s": 30.0, "consumer": "t"},
            "pop_take": {"queue_id": qid, "n": 250, "archive": False},
            "drop_queue": {"queue_id": qid},
        }
        for name, params in cases.items():
            row = c.execute(b"EXPLAIN (FORMAT JSON) " + dbq.db.query(name), params).fetchone()
            assert row is not None
            assert _walks_data(row[0][0]["Plan"]) == [], name
