"""Short versions of benchmarks/soak.py (the long soaks live there): every message comes through once,
counted and checksummed, and a ring's table stays within a stated bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SOAK_PY = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def soak(pg_dsn: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(SOAK_PY), *args, "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, DBQUEUE_TEST_DSN=pg_dsn),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    assert result["errors"] == []
    assert result["pushed"] == result["popped"] == result["messages"]
    assert result["checksum_ok"] and (result["lost"], result["duplicated"]) == (0, 0)
    assert result["left_in_queue"] == 0
    return result


def test_ring_soak_short_stays_within_its_bound(pg_dsn: str) -> None:
    """80 wraps of a ring by 2 producers and 2 consumers: every message once, and a bounded table.

    Stated bound: the ring's heap ends within 2x of its size after the first thousand messages; a ring
    whose updates left their pages for good grew without end (the issue measured ~190 MiB per million
    messages before the ring was HOT). Measured here with this small ring, which wraps every 35 ms:
    1.22-1.38x (three runs). Under concurrency some old slot versions cannot be pruned before the
    slot's next update (a snapshot still sees them), so a few updates leave their page in the first
    wraps; longer soaks (benchmarks/soak.py) stay flat after that (docs/benchmarks.md).
    """
    r = soak(
        pg_dsn,
        *("--design", "ring", "--messages", "40000", "--capacity", "500", "--batch", "100"),
        *("--report-every", "10000"),
    )
    base, last = r["baseline"], r["samples"][-1]
    assert base["messages"] >= 1000 and last["messages"] == 40000
    assert last["heap_bytes"] <= 2 * base["heap_bytes"], (base, last)
    assert last["hot_ratio"] is not None and last["hot_ratio"] > 0.9, last


def test_table_soak_short_with_maintenance(pg_dsn: str) -> None:
    r = soak(
        pg_dsn,
        "--design",
        "table",
        "--messages",
        "20000",
        "--batch",
        "100",
        "--maintain-every",
        "0.5",
        "--report-every",
        "10000",
    )
    assert r["samples"][-1]["messages"] == 20000
