"""Short version of benchmarks/cost.py: per-message client CPU, server CPU and WAL of a design and of
the naive queue, on one connection. No cost is asserted: only that every side is measured (the server
of the tests runs on this machine, so its CPU is read from /proc) and that the script's own check of
what went in and came out passes, and that the check fails when a message is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

pytestmark = pytest.mark.integration

COST_PY = Path(__file__).resolve().parents[2] / "benchmarks" / "cost.py"


@pytest.mark.parametrize(("design", "batch"), [("ring", 100), ("ring", 1), ("table", 100)])
def test_short_cost_run_measures_every_side(pg_dsn: str, design: str, batch: int) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(COST_PY),
            "--design",
            design,
            "--batch",
            str(batch),
            "--batches",
            "20",
            "--rounds",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, DBQUEUE_TEST_DSN=pg_dsn),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["server_cpu"] is True
    assert r["messages_per_round"] == 20 * batch
    for prefix in ("", "naive_"):
        for side in ("push", "pop", "cycle"):
            assert r[f"{prefix}{side}_client_us"] > 0, (prefix, side, r)
            assert r[f"{prefix}{side}_server_us"] >= 0, (prefix, side, r)
            assert r[f"{prefix}{side}_wal_bytes"] > 0, (prefix, side, r)
        assert r[f"{prefix}cycle_client_us"] == pytest.approx(
            r[f"{prefix}push_client_us"] + r[f"{prefix}pop_client_us"]
        )


def test_cost_check_refuses_a_lost_or_changed_message() -> None:
    cost = load_benchmark("cost")
    sent = [[b"a" * 20, b"b" * 20], [b"c" * 20]]
    cost.check(sent, [b"c" * 20, b"a" * 20, b"b" * 20], "ring")  # order does not matter
    with pytest.raises(SystemExit, match="popped 2"):
        cost.check(sent, [b"a" * 20, b"b" * 20], "ring")
    with pytest.raises(SystemExit, match="checksums differ"):
        cost.check(sent, [b"a" * 20, b"b" * 20, b"d" * 20], "ring")
