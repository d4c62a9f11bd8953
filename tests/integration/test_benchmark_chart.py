"""benchmarks/chart.py draws what benchmarks/run.py --json measured: a real short run, charted.

No speed is asserted: the test checks that the SVG is well-formed and that its bars and ratio labels
carry exactly the figures of the run's JSON output (which differ from run to run, so they cannot be
hard-coded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SVG = "{http://www.w3.org/2000/svg}"


def _bench(pg_dsn: str, semantics: str) -> str:
    proc = subprocess.run(
        [
            *(sys.executable, str(BENCH / "run.py"), "--design", "table", "--semantics", semantics),
            *("--producers", "1", "--consumers", "1", "--batch", "100"),
            *("--seconds", "1", "--warmup", "0.5", "--json"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, DBQUEUE_TEST_DSN=pg_dsn),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_chart_of_a_real_run_carries_its_measured_values(pg_dsn: str, tmp_path: Path) -> None:
    # Two runs: one handed over in a file, the other on standard input.
    first = tmp_path / "at-most-once.jsonl"
    first.write_text(_bench(pg_dsn, "at-most-once"))
    second = _bench(pg_dsn, "at-least-once")
    points: list[dict[str, Any]] = [
        json.loads(line) for text in (first.read_text(), second) for line in text.splitlines() if line.strip()
    ]
    assert [p["semantics"] for p in points] == ["at-most-once", "at-least-once"]
    assert all(p["valid"] and p["cycles_per_s"] > 0 and p["baseline_cycles_per_s"] > 0 for p in points)

    out = tmp_path / "chart.svg"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "chart.py"), str(first), "-", "-o", str(out), "--caption", "a test run"],
        input=second,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    root = ET.parse(out).getroot()  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg"

    bars = {
        (b.get("data-semantics"), b.get("data-series")): b
        for b in root.iter(f"{SVG}rect")
        if b.get("class") == "bar"
    }
    assert len(bars) == 4  # the design and the baseline, for each semantics
    for p in points:
        for series in ("cycles_per_s", "baseline_cycles_per_s"):
            bar = bars[(p["semantics"], series)]
            assert float(bar.get("data-value", "nan")) == p[series]
            assert (bar.get("data-producers"), bar.get("data-batch")) == ("1", "100")
            assert float(bar.get("height", "0")) > 0
            assert f"{p[series]:,.1f} cycles/s" in (bar.findtext(f"{SVG}title") or "")
    ratios = sorted(
        float(t.get("data-ratio", "nan")) for t in root.iter(f"{SVG}text") if t.get("class") == "ratio"
    )
    assert ratios == sorted(p["ratio"] for p in points)
    text = " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))
    assert f"PostgreSQL {points[0]['pg_version']}" in text
    assert "payload 300 B" in text and "a test run" in text
    # The taller of each pair of bars is the larger value: heights follow the data, not a layout constant.
    for p in points:
        h = {
            s: float(bars[(p["semantics"], s)].get("height", "0"))
            for s in ("cycles_per_s", "baseline_cycles_per_s")
        }
        assert (h["cycles_per_s"] > h["baseline_cycles_per_s"]) == (
            p["cycles_per_s"] > p["baseline_cycles_per_s"]
        )
