"""benchmarks/chart.py refuses what is not run.py's throughput output, clearly, and writes nothing then.

The chart of a real benchmark run is tested in tests/integration/test_benchmark_chart.py.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

CHART = Path(__file__).resolve().parents[2] / "benchmarks" / "chart.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_chart", CHART)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_chart"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


chart = _module()


def _point(**over: Any) -> dict[str, Any]:
    p = {
        "design": "table",
        "semantics": "at-most-once",
        "producers": 2,
        "consumers": 2,
        "batch": 100,
        "cycles_per_s": 1234.5,
        "baseline_cycles_per_s": 1000.0,
        "ratio": 1.235,
        "valid": True,
    }
    p.update(over)
    return p


def _run(tmp_path: Path, text: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.svg"
    src.write_text(text)
    proc = subprocess.run(
        [sys.executable, str(CHART), str(src), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc, out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no points in the input"),
        ("design table\n", "in.jsonl:1: not JSON"),
        (json.dumps(_point()) + "\n[1, 2]\n", "in.jsonl:2: expected a JSON object"),
        (json.dumps({k: v for k, v in _point().items() if k != "cycles_per_s"}), "missing 'cycles_per_s'"),
        (json.dumps(_point(batch="100")), "'batch' must be a whole number"),
        (json.dumps(_point(cycles_per_s=-1)), "'cycles_per_s' must not be negative"),
        (json.dumps({"mode": "maintenance", "design": "table"}), "--maintenance point"),
        (json.dumps(_point()) + "\n" + json.dumps(_point()), "already measured at"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(tmp_path: Path, text: str, message: str) -> None:
    proc, out = _run(tmp_path, text)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""
    assert not out.exists()


def test_missing_file_is_named(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(CHART), str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr and proc.stdout == ""


def test_invalid_points_are_marked_and_missing_points_said(tmp_path: Path) -> None:
    text = "\n".join(
        json.dumps(p)
        for p in (
            _point(valid=False),
            _point(
                producers=1, consumers=1, batch=1, cycles_per_s=900.0, baseline_cycles_per_s=1500.0, ratio=0.6
            ),
        )
    )
    proc, out = _run(tmp_path, text)
    assert proc.returncode == 0, proc.stderr
    words = " ".join(ET.parse(out).getroot().itertext())
    assert "INVALID" in words  # the 2x2 batch 100 point
    assert "not run" in words  # 2x2 at batch 1 and 1x1 at batch 100 were not measured
    assert "\u00d70.60" in words


def test_ticks_cover_the_largest_value_in_round_steps() -> None:
    for top in (0.5, 7, 918, 1234.5, 36_765, 99_999, 100_000, 2.5e6):
        ticks = chart.nice_ticks(top)
        assert ticks[0] == 0 and ticks[-1] >= top
        step = ticks[1]
        assert all(abs(b - a - step) < 1e-6 * step for a, b in itertools.pairwise(ticks))
        mantissa = step / 10 ** int(f"{step:e}".split("e")[1])
        assert round(mantissa, 6) in (1, 2, 2.5, 5)
        assert len(ticks) <= 11


def test_short_labels() -> None:
    values = (918.4, 999.6, 1509, 9999.5, 36_765, 999_960, 1_234_567)
    assert [chart.fmt(v) for v in values] == ["918", "1.00k", "1.51k", "10.0k", "36.8k", "1.0M", "1.2M"]
