"""A short run of benchmarks/waiters.py (the measured runs live in docs/benchmarks.md): every message
comes through once, counted and checksummed, in both modes and on both sides; and its check fails when
a message is missing, duplicated or changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import load_benchmark

pytestmark = pytest.mark.integration

WAITERS_PY = Path(__file__).resolve().parents[2] / "benchmarks" / "waiters.py"


def _run(pg_dsn: str, *args: str) -> list[dict[str, Any]]:
    """waiters.py's JSON rows for a 1 s point of 1 and 4 waiters on the given server."""
    proc = subprocess.run(
        [
            sys.executable,
            str(WAITERS_PY),
            "--waiters",
            "1",
            "4",
            "--seconds",
            "1",
            "--settle",
            "0.5",
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, DBQUEUE_TEST_DSN=pg_dsn),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _every_message_once(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        assert r["pushed"] == r["delivered"] == 50 and r["checksum_ok"], r
        assert (r["lost"], r["duplicated"], r["errors"]) == (0, 0, {}), r
        assert r["stops_taken"] == r["waiters"]


def test_a_short_run_delivers_every_message_once(pg_dsn: str) -> None:
    rows = _run(pg_dsn)
    assert {(r["mode"], r["waiters"], r["design"]) for r in rows} == {
        (mode, w, side) for mode in ("threads", "processes") for w in (1, 4) for side in ("table", "naive")
    }
    _every_message_once(rows)
    for r in rows:
        assert r["server_cpu_s"] is None  # a given server: its processes are not the benchmark's


@pytest.mark.parametrize("design", ["ring", "ring-rows"])
def test_a_short_run_of_a_ring_delivers_every_message_once(pg_dsn: str, design: str) -> None:
    """The ring's layouts by run.py's names: ``ring`` the slots layout, ``ring-rows`` the rows layout."""
    rows = _run(pg_dsn, "--design", design, "--mode", "threads", "processes", "--no-naive")
    assert {(r["mode"], r["waiters"], r["design"]) for r in rows} == {
        (mode, w, design) for mode in ("threads", "processes") for w in (1, 4)
    }
    assert {r["layout"] for r in rows} == {"slots" if design == "ring" else "rows"}
    _every_message_once(rows)


def test_the_check_fails_on_a_lost_duplicated_or_changed_message() -> None:
    waiters = load_benchmark("waiters")
    args = waiters.parse_args(["--seconds", "1"])
    pushed = {0: (0.0, 11), 1: (0.0, 22)}
    stop = (waiters.STOP, 0.0, 33)

    def point(taken: list[tuple[int, float, int]]) -> bool:
        results = [{"taken": [*taken, stop], "errors": {}, "cpu_s": 0.0, "wakes": 0}]
        r = waiters.summary(args, "threads", 1, 1, results, pushed, Counter(), 1.0, None)
        return bool(waiters.valid(r))

    assert point([(0, 0.0, 11), (1, 0.0, 22)])
    assert not point([(0, 0.0, 11)])  # lost
    assert not point([(0, 0.0, 11), (1, 0.0, 22), (1, 0.0, 22)])  # duplicated
    assert not point([(0, 0.0, 11), (1, 0.0, 23)])  # changed
