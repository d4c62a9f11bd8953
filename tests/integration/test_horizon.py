"""A held xmin horizon, maintenance side, on a real PostgreSQL: with a REPEATABLE READ transaction open
during a run, the run names it, rebuilds no index behind it (an online rebuild would wait for it up to
its timeout), reports the rebuilds that did not complete, and `dbqueue maintain` exits 1; once the
transaction ends, the next run rebuilds and exits 0. The same decision on SQL Server is checked on a
fake connection (tests/unit/test_mssql_maintenance.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from airflow_dbqueue.engine import DbQueue, MaintenanceConfig
from tests.helpers import held_horizon

pytestmark = pytest.mark.integration

EVERY_INDEX = {"reindex_bloat_ratio": 1.0, "reindex_min_bytes": 0}
"""Rebuild every B-tree index at least its estimated size: a run has rebuilds to do."""


def test_a_run_rebuilds_no_index_behind_a_held_horizon(dbq: DbQueue, pg_dsn: str) -> None:
    q = dbq.create_queue("orders")
    q.push_batch([{"n": i} for i in range(200)])
    q.pop(200)
    config = MaintenanceConfig(archive_after_s=0, horizon_min_age_s=1, reindex_timeout_s=120, **EVERY_INDEX)
    conn = held_horizon(pg_dsn)
    try:
        time.sleep(1.5)
        t0 = time.monotonic()
        report = dbq.maintain(config)
        took = time.monotonic() - t0
        pid = conn.info.backend_pid
    finally:
        conn.close()
    assert took < 30, f"the run queued behind the transaction for {took:.0f}s"
    assert any(h["pid"] == pid for h in report["xmin_holders"])
    actions = report["indexes"]["actions"]
    assert actions and all(a["action"] == "skip" and not a["ok"] for a in actions), actions
    assert all(f"pid {pid}" in a["error"] and "report-job" in a["error"] for a in actions)
    assert [i["object"] for i in report["incomplete"]] == [a["index"] for a in actions]
    assert report["archive"]["rows"] == 200  # the other steps did their work
    after = dbq.maintain(config)  # the transaction ended: the rebuilds run
    assert after["incomplete"] == [] and after["indexes"]["actions"]
    assert all(a["action"] == "reindex" and a["ok"] for a in after["indexes"]["actions"])


def run_maintain(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "airflow_dbqueue.cli", "--dsn", pg_dsn, "--schema", schema, "maintain", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_dbqueue_maintain_takes_the_threshold_and_exits_1_when_a_step_did_not_complete(
    dbq: DbQueue, pg_dsn: str
) -> None:
    dbq.create_queue("orders").push_batch([{"n": i} for i in range(50)])
    args = (
        "--archive-after",
        "0",
        "--reindex-bloat-ratio",
        "1",
        "--reindex-min-bytes",
        "0",
        "--reindex-timeout",
        "120",
    )
    conn = held_horizon(pg_dsn)
    try:
        time.sleep(1.5)
        held = run_maintain(pg_dsn, dbq.schema, *args, "--horizon-min-age", "1")
        pid = conn.info.backend_pid
    finally:
        conn.close()
    report = json.loads(held.stdout)
    assert held.returncode == 1, held.stderr
    assert any(h["pid"] == pid for h in report["xmin_holders"])
    assert report["incomplete"] and "dbqueue: maintenance did not complete: skip " in held.stderr
    done = run_maintain(pg_dsn, dbq.schema, *args, "--horizon-min-age", "1")
    assert done.returncode == 0 and json.loads(done.stdout)["incomplete"] == []


def test_no_rebuild_runs_behind_a_long_transaction_on_sql_server(mssql_dsn: str, schema_name: str) -> None:
    """SQL Server given $DBQUEUE_TEST_MSSQL_DSN (skipped otherwise; never run yet): a transaction of
    another session open for over a second; every index the run would rebuild is skipped, naming it."""
    from tests.conftest import installed_dbq

    with installed_dbq(mssql_dsn, schema_name, dialect="mssql") as dbq:
        dbq.create_queue("q").push_batch([{"n": i} for i in range(50)])
        other = dbq.db.connect(application_name="long-report")  # type: ignore[attr-defined]
        try:
            other.cursor().execute(f"UPDATE [{schema_name}].queues SET archive = archive WHERE name = N'q'")
            time.sleep(1.5)
            out = dbq.maintenance().rebuild_indexes(
                reindex_bloat_ratio=1.0,
                reindex_min_bytes=0,
                reindex_fragmentation_pct=0,
                horizon_min_age=1,
                reindex_timeout=120,
            )
        finally:
            other.rollback()
            other.close()
        rebuilds = [
            a
            for a in out["actions"]
            if a["reason"] != "disabled (ALTER INDEX ... DISABLE): left to its owner"
        ]
        assert rebuilds and all(a["action"] == "skip" and not a["ok"] for a in rebuilds), rebuilds
        assert all("long-report" in a["error"] for a in rebuilds)
