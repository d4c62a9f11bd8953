"""Smoke test of benchmarks/run.py: a short run per semantics is valid and measures something.

No speed is asserted: only that the benchmark runs, checks its own correctness (nothing lost or
duplicated) and reports both the design's and the naive baseline's cycles per second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

RUN_PY = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"


def _run(pg_dsn: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DBQUEUE_TEST_DSN=pg_dsn)
    return subprocess.run(
        [sys.executable, str(RUN_PY), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("semantics", ["at-most-once", "at-least-once"])
def test_short_run_is_valid(pg_dsn: str, semantics: str) -> None:
    proc = _run(
        pg_dsn,
        "--design",
        "table",
        "--producers",
        "1",
        "--consumers",
        "1",
        "--batch",
        "100",
        "--seconds",
        "2",
        "--json",
        "--semantics",
        semantics,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    point: dict[str, Any] = json.loads(lines[0])
    assert point["design"] == "table"
    assert point["semantics"] == semantics
    assert (point["producers"], point["consumers"], point["batch"]) == (1, 1, 100)
    assert point["payload_bytes"] == 300
    assert point["lost"] == 0
    assert point["duplicated"] == 0
    assert point["baseline_lost"] == 0
    assert point["baseline_duplicated"] == 0
    assert point["cycles_per_s"] > 0
    assert point["baseline_cycles_per_s"] > 0
    assert point["valid"] is True
    for key in ("ratio", "table_bytes", "dead_tuples", "wal_bytes_per_msg", "seconds"):
        assert key in point


def test_short_ring_run_is_valid(pg_dsn: str) -> None:
    proc = _run(
        pg_dsn,
        *("--design", "ring", "--producers", "1", "--consumers", "1", "--batch", "100"),
        *("--seconds", "1", "--warmup", "0.5", "--json", "--capacity", "2000"),
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert (point["design"], point["capacity"], point["valid"]) == ("ring", 2000, True)
    assert (point["lost"], point["duplicated"], point["left_in_queue"]) == (0, 0, 0)
    assert point["cycles_per_s"] > 0
    assert point["hot_update_ratio"] is not None


def test_unknown_design_is_refused(pg_dsn: str) -> None:
    proc = _run(pg_dsn, "--design", "heap", "--producers", "1", "--seconds", "1")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
    assert proc.stdout == ""


def test_maintenance_mode_reports_latency_percentiles_with_and_without(pg_dsn: str) -> None:
    proc = _run(
        pg_dsn,
        "--maintenance",
        "--producers",
        "1",
        "--batch",
        "100",
        "--seconds",
        "4",  # long enough for a maintenance run to finish on a loaded machine (1.5 s was not, at times)
        "--warmup",
        "0.5",
        "--semantics",
        "at-least-once",
        "--json",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert point["mode"] == "maintenance" and point["valid"] is True
    assert (point["lost"], point["duplicated"]) == (0, 0)
    for op in ("push", "pop", "ack"):
        assert point[f"{op}_calls_off"] > 0 and point[f"{op}_calls_on"] > 0
        for pct in (50, 95, 99):
            assert point[f"{op}_p{pct}_ms_off"] > 0 and point[f"{op}_p{pct}_ms_on"] > 0
            assert point[f"{op}_p{pct}_ratio"] is not None
    assert point["maintenance"]["runs"] >= 1 and point["maintenance"]["archived"] > 0
