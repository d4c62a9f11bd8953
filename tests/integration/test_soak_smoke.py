"""Short versions of benchmarks/soak.py (the long soaks live there): every message comes through once,
counted and checksummed, and a ring's table stays within a stated bound; and soak.py's check fails
when a message is missing or duplicated."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import load_benchmark

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

    Stated bound: the ring's heap ends within 4x of its size after the first thousand messages, and
    nine of ten updates are HOT; a ring whose updates left their pages for good grew without end (about
    190 MiB per million messages in a soak before the ring was HOT: at that rate this run would end
    near 7.6 MiB, some 17x its baseline).
    Measured here with this small ring, which wraps every 35 ms: 1.0x in four runs on a quiet machine,
    1.22-1.38x in three earlier ones, 2.13x once in a full test run on a loaded machine. Under
    concurrency some old slot versions cannot be pruned before the slot's next update (a snapshot still
    sees them, and on a loaded machine a snapshot's holder can wait long for a core), so some updates
    leave their page in the first wraps; longer soaks (benchmarks/soak.py) stay flat after that
    (docs/benchmarks.md).
    """
    r = soak(
        pg_dsn,
        *("--design", "ring", "--messages", "40000", "--capacity", "500", "--batch", "100"),
        *("--report-every", "10000"),
    )
    base, last = r["baseline"], r["samples"][-1]
    assert base["messages"] >= 1000 and last["messages"] == 40000
    assert last["heap_bytes"] <= 4 * base["heap_bytes"], (base, last)
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


@pytest.mark.parametrize("design", ["ring", "ring-rows", "table"])
def test_soak_with_a_held_horizon(pg_dsn: str, design: str) -> None:
    """--hold-after 0 --hold-for 5: a REPEATABLE READ snapshot held from the start for 5 s (or until
    the soak ends, if sooner). Every message still comes through once; the samples say when the hold
    was on; the ring's samples taken while it held show dead tuples (nothing could remove them) and the
    samples after it say the hold is off; the hold saw other transactions after its snapshot. The
    table design's maintenance runs meanwhile (its online rebuilds wait for the hold). The workers
    take a second or two to start and their backends report dead tuples about once a second, so the
    hold lasts 5 s, long enough for them to report while it holds. (about 10 s each)"""
    extra = {
        "ring": ("--capacity", "500"),
        # 64 pushes in four segments of 16: the 600 pushes rotate each segment several times
        "ring-rows": ("--rows-capacity", "64"),
        "table": ("--maintain-every", "0.5"),
    }[design]
    r = soak(
        pg_dsn,
        *("--design", design, "--messages", "60000", "--batch", "100", "--report-every", "20000"),
        *("--hold-after", "0", "--hold-for", "5", *extra),
    )
    assert (r["hold_after_s"], r["hold_for_s"]) == (0, 5)
    assert r["hold_started_s"] is not None and r["hold_ended_s"] >= r["hold_started_s"]
    assert r["hold_xmin_age"] is not None and r["hold_xmin_age"] > 0
    holds = [s["hold"] for s in r["samples"]]
    assert True in holds and holds[-1] is False, holds
    # The ring's dead tuples show while the hold is on. The table design's consumers empty each
    # consumed partition with its dead rows within about a second (their DbQueue's recycling), so no
    # sample of it need show any: the hold's xmin age above says it held.
    if design == "ring":
        assert max(s["dead"] for s in r["samples"] if s["hold"]) > 0, r["samples"]
    if design == "ring-rows":  # the samples read the ring's own tables (its segments, position logs)
        assert r["capacity"] == 64
        assert min(s["total_bytes"] for s in r["samples"]) > 0, r["samples"]
        assert len(r["samples"][-1]["table_bytes"]) == 8, r["samples"][-1]
    assert r["samples"][-1]["messages"] == 60000
    refused = subprocess.run(
        [sys.executable, str(SOAK_PY), "--hold-for", "3"], capture_output=True, text=True, check=False
    )
    assert refused.returncode == 2 and "--hold-after and --hold-for go together" in refused.stderr


def test_soak_check_refuses_a_lost_or_duplicated_message() -> None:
    """soak.py's own check (what the tests above trust): producers' and consumers' (count, checksum)
    reports, made with its own digests, disagree when a message is missing, duplicated, or one of each."""
    soak_py = load_benchmark("soak")
    fillers = soak_py.Fillers(300, soak_py.PAYLOAD_HEADER.size)
    sent = [soak_py.make(soak_py.PAYLOAD_HEADER, fillers, 0, s) for s in range(5)]  # as producers do

    def report(payloads: list[bytes]) -> tuple[int, int]:
        return len(payloads), int(soak_py.add_digests(0, payloads))

    pushed = [report(sent[:3]), report(sent[3:])]  # two producers

    def verdict(*popped: list[bytes], left: int = 0) -> tuple[bool, int, int, bool]:
        """(checksum_ok, lost, duplicated, valid) of a soak whose consumers popped ``popped``."""
        result = soak_py.tally(pushed, [report(p) for p in popped], left)
        assert (result["pushed"], result["popped"]) == (5, sum(map(len, popped)))
        ok = soak_py.valid({**result, "errors": [], "left_in_queue": left}, len(sent))
        return result["checksum_ok"], result["lost"], result["duplicated"], ok

    assert verdict(sent[3:], sent[:3]) == (True, 0, 0, True)  # order and consumers do not matter
    assert verdict(sent[:2], sent[3:]) == (False, 1, 0, False)  # sent[2] missing
    assert verdict(sent, [sent[2]]) == (False, 0, 1, False)  # sent[2] twice
    assert verdict(sent[:4], [sent[0]]) == (False, 0, 0, False)  # one lost, one twice: counts agree
    assert verdict(sent[:4], left=1) == (False, 0, 0, False)  # still queued: not lost, not done


def test_a_paced_soak_reports_the_rates_around_the_hold(pg_dsn: str) -> None:
    """--rate 4000 for about 16 s with a 4 s hold from the eighth second (the long version is 10
    minutes with a 5-minute hold, docs/benchmarks.md): the producers keep to the rate (never ahead of
    it), and the report has the rates of the stretch before the hold, of the hold's end and after it,
    computed from the per-second timeline, and the longest pop; every message once. How fast the
    consumers start and keep up depends on the machine (a late start gives 0 before the hold, a
    catch-up more than the rate after it), so the rates are checked for being there, not for values."""
    r = soak(
        pg_dsn,
        *("--design", "table", "--messages", "64000", "--batch", "100", "--rate", "4000"),
        *("--hold-after", "8", "--hold-for", "4", "--report-every", "16000", "--maintain-every", "300"),
    )
    assert r["rate"] == 4000
    assert r["seconds"] >= 64000 / 4000 * 0.9, r["seconds"]  # paced: not faster than the rate
    points = r["timeline"]
    assert len(points) >= 10 and all(b[0] > a[0] and b[1] >= a[1] for a, b in itertools.pairwise(points))
    for key in ("rate_before_hold", "rate_hold_last_minute", "rate_after_hold"):
        assert r[key] is not None and r[key] >= 0, (key, r[key])
    before = r["rate_before_hold"]
    assert r["hold_kept"] == (round(r["rate_hold_last_minute"] / before, 3) if before else None)
    assert r["longest_pop_s"] is not None and r["longest_pop_s"] > 0
