"""Smoke test of benchmarks/spark_paths.py on the test session's Spark Connect server: a short run is
valid (every order counted exactly once, the queue drained) and reports what it measured, and so are
its pushes through the event-driven DAG under a real api-server, triggerer and scheduler
(``--events``). No speed is asserted. The spark-submit column is left out here (the operator's tests
run that path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_dbqueue.spark.connect_server import LocalConnectServer

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "spark_paths.py"


def test_a_short_run_on_connect_is_exactly_once(connect_server: LocalConnectServer, pg_dsn: str) -> None:
    """Batches without Airflow, then two pushes of 400 orders through the event-driven DAG (about 40 s
    of the test: Airflow's components start, and each push is a run)."""
    args = ["--messages", "900", "--batch", "400", "--paths", "connect", "--warm-up", "1", "--events", "2"]
    args += ["--connect-url", connect_server.url]
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), *args, "--dsn", pg_dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    [row] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert row["path"] == "connect" and row["exactly_once"] is True
    assert (row["messages"], row["batches"]) == (900, 3)  # 400 + 400 + 100
    assert row["p50_s"] > 0 and row["orders_per_s"] > 0 and len(row["warm_up_s"]) == 1
    # each push was taken by a run the watcher started (a push taken by the run before leaves the next
    # run nothing; if_empty="success" lets it end green), and counted once
    assert row["events_exactly_once"] is True and row["events_runs"].get("failed", 0) == 0
    assert sum(row["events_runs"].values()) >= 2 and len(row["events_s"]) == 2
    assert all(s > 0 for s in row["events_s"]) and row["events_p50_s"] > 0


def test_both_designs_on_connect_are_exactly_once(connect_server: LocalConnectServer, pg_dsn: str) -> None:
    """--designs table,ring: the same orders through the table design and a ring, one after the other
    on one server, each counted exactly once with its queue drained, and each batch's read measured
    alone (the batch query from Python, the job's JDBC read)."""
    args = ["--messages", "900", "--batch", "400", "--paths", "connect", "--warm-up", "1"]
    args += ["--designs", "table,ring", "--connect-url", connect_server.url]
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), *args, "--dsn", pg_dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["path"], r["design"]) for r in rows] == [("connect", "table"), ("connect", "ring")]
    for row in rows:
        assert row["exactly_once"] is True and (row["messages"], row["batches"]) == (900, 3), row
        assert row["orders_per_s"] > 0 and row["read_psql_p50_s"] > 0 and row["read_jdbc_p50_s"] > 0, row
        parts = (row["claim_p50_s"], row["job_p50_s"], row["publish_ack_p50_s"])
        assert all(p > 0 for p in parts), row


def test_bad_arguments_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--paths", "yarn"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and "--paths" in proc.stderr
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--designs", "heap"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and "--designs" in proc.stderr
