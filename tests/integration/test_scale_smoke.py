"""The short version of benchmarks/scale.py (--quick): a depth point, a many-queues point and a ring of
each layout, every message counted and its bytes checked, the stats' figures against what was pushed
and popped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCALE_PY = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"


def test_the_quick_scale_run_moves_every_message_once_and_counts_them(pg_dsn: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCALE_PY), "--quick", "--json", "--dsn", pg_dsn],
        capture_output=True,
        text=True,
        env=dict(os.environ, DBQUEUE_TEST_DSN=pg_dsn),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    depth, queues, rings = (json.loads(line) for line in proc.stdout.splitlines())
    assert depth["point"] == "depth" and depth["depth"] == 20_000
    for side in ("engine", "naive"):
        r = depth[side]
        assert r["checksum_ok"] and r["bad_payloads"] == 0 and r["pushed"] == r["popped"] >= 30_000, r
    assert depth["stats_left"] == depth["stats_left_expected"] > 0
    assert depth["stats"]["ready"] == depth["stats_left"] and "estimated" not in depth["stats"]
    assert all(v["median"] > 0 for v in depth["msgs_per_s"].values())
    assert queues["point"] == "queues" and queues["queues"] == 100
    assert queues["stats_figures_ok"] and queues["left_in_queues"] == 0
    assert queues["samples_recorded"] == 100 and queues["maintain_incomplete"] == []
    assert queues["engine"]["checksum_ok"] and queues["engine"]["pushed"] == 100 * queues["per_queue"]
    assert (rings["point"], rings["capacity"], set(rings["layouts"])) == ("rings", 10_000, {"slots", "rows"})
    assert rings["engine"]["checksum_ok"] and rings["engine"]["pushed"] == 2 * rings["batch"]
    # the slots layout lays out its capacity at creation (each slot a row), the rows layout does not
    assert rings["layouts"]["slots"]["bytes_added"] > 10_000 * 64 > rings["layouts"]["rows"]["bytes_added"]
