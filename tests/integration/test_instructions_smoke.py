"""Short version of benchmarks/instructions.py: server instructions a message of each design and of
the naive queue, counted by cachegrind in a PostgreSQL server of its own. No cost is asserted: only
that every side is counted, that the counts grow with the work (a longer session counts more), and
that the script's check of what went in and came out fails when a pop loses or adds a message."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_benchmark, require

pytestmark = pytest.mark.integration

INSTRUCTIONS_PY = Path(__file__).resolve().parents[2] / "benchmarks" / "instructions.py"


@pytest.mark.parametrize(
    ("extra", "designs", "reference"),
    [
        ((), ["ring", "ring-rows", "table"], "naive"),
        # at least once the pop sessions ack, and the reference is PGMQ's read and archive
        (("--design", "table", "--semantics", "at-least-once", "--archive"), ["table"], "pgmq"),
        # both sides as they run behind a transaction pooler: nothing prepared
        (("--design", "ring", "--pooler", "transaction"), ["ring"], "naive"),
    ],
)
def test_short_run_counts_every_side_of_both_designs(
    extra: tuple[str, ...], designs: list[str], reference: str
) -> None:
    require(None if shutil.which("valgrind") else "valgrind is not installed", "apt-get install valgrind")
    proc = subprocess.run(
        [sys.executable, str(INSTRUCTIONS_PY), "--batch", "10", "--calls", "2", "--json", *extra],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    assert [(r["design"], r["batch"], r["reference"]) for r in rows] == [(d, 10, reference) for d in designs]
    for r in rows:
        assert r["pooler"] == ("transaction" if "--pooler" in extra else "none")
        for prefix in ("", "naive_"):
            for side in ("push", "pop"):
                # a message costs the server thousands of instructions: a count near zero would mean
                # the sessions' backends were not the ones counted
                assert r[f"{prefix}{side}_instructions"] > 1000, (prefix, side, r)
            assert r[f"{prefix}cycle_instructions"] == pytest.approx(
                r[f"{prefix}push_instructions"] + r[f"{prefix}pop_instructions"], abs=1
            )


def test_short_run_counts_each_feature_of_the_table_design() -> None:
    """--feature counts the table design once a feature, each a queue of its own: every row is counted,
    and a push with a key, a deduplication key or a ttl costs more than the default queue's (a count no
    higher would mean the option was not sent)."""
    require(None if shutil.which("valgrind") else "valgrind is not installed", "apt-get install valgrind")
    features = ["none", "ordering", "dedup", "ttl"]
    proc = subprocess.run(
        [
            *(sys.executable, str(INSTRUCTIONS_PY), "--design", "table", "--batch", "10", "--calls", "2"),
            *("--json", "--feature", *features),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["feature"]: r for r in json.loads(proc.stdout)}
    assert list(rows) == features and {(r["design"], r["batch"]) for r in rows.values()} == {("table", 10)}
    for r in rows.values():
        assert r["push_instructions"] > 1000 and r["pop_instructions"] > 1000, r
    for f in features[1:]:
        assert rows[f]["push_instructions"] > rows["none"]["push_instructions"], (f, rows)


@pytest.mark.parametrize("semantics", ["at-most-once", "at-least-once"])
def test_short_run_counts_ordering_per_key_over_each_number_of_keys(semantics: str) -> None:
    """--ordering-keys counts ordering per key once a number of keys, each a row naming it: over 3 keys
    a pop of 10 gets at most 3 messages, and the pop session pops on until it has every message its push
    session sent (the script's check of what came out, counted and checksummed, fails otherwise)."""
    require(None if shutil.which("valgrind") else "valgrind is not installed", "apt-get install valgrind")
    proc = subprocess.run(
        [
            *(sys.executable, str(INSTRUCTIONS_PY), "--design", "table", "--batch", "10", "--calls", "2"),
            *("--json", "--feature", "none", "ordering", "--ordering-keys", "3", "1000"),
            *("--semantics", semantics),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    assert [(r["feature"], r["ordering_keys"]) for r in rows] == [
        ("none", None),
        ("ordering", 3),
        ("ordering", 1000),
    ]
    for r in rows:
        assert r["push_instructions"] > 1000 and r["pop_instructions"] > 1000, r
        assert r["semantics"] == semantics
    assert all(r["push_instructions"] > rows[0]["push_instructions"] for r in rows[1:]), rows


def test_short_client_run_counts_the_client_of_the_ring_and_of_the_naive_queue() -> None:
    """--client runs every session in a Python of its own under cachegrind: the client's count of each
    side is there for the engine and for the naive queue, and grows with the work."""
    require(None if shutil.which("valgrind") else "valgrind is not installed", "apt-get install valgrind")
    proc = subprocess.run(
        [
            sys.executable,
            str(INSTRUCTIONS_PY),
            *("--design", "ring", "--batch", "10", "--calls", "1", "--client", "--json"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    [r] = json.loads(proc.stdout)
    assert r["pop"] == "payloads"  # the default: pop_payloads, against the naive queue's payload column
    for prefix in ("", "naive_"):
        for side in ("push", "pop"):
            # a message costs a Python client thousands of instructions: a count near zero would
            # mean the sessions ran outside the counted processes
            assert r[f"{prefix}client_{side}_instructions"] > 1000, (prefix, side, r)
            assert r[f"{prefix}{side}_instructions"] > 1000, (prefix, side, r)
        assert r[f"{prefix}client_cycle_instructions"] == (
            r[f"{prefix}client_push_instructions"] + r[f"{prefix}client_pop_instructions"]
        )


class _Uncounted:
    """Stands in for the server under cachegrind in the check's test: it counts nothing, so that
    only what the sessions pushed and popped is examined."""

    def counted(self, pids: set[int]) -> int:
        return len(pids)


def test_measure_fails_when_a_pop_loses_or_adds_a_message() -> None:
    instructions = load_benchmark("instructions")
    box: list[list[bytes]] = []

    def push(sent: list[list[bytes]]) -> set[int]:
        box[:] = sent
        return {1}

    def pop_all(calls: int) -> tuple[list[bytes], set[int]]:
        return [p for b in box for p in b], {2}

    def pop_one_short(calls: int) -> tuple[list[bytes], set[int]]:
        return [p for b in box for p in b][1:], {2}

    def pop_one_more(calls: int) -> tuple[list[bytes], set[int]]:
        return [p for b in box for p in b] + [box[0][0]], {2}

    def pop_one_twice(calls: int) -> tuple[list[bytes], set[int]]:  # as many, one of them twice
        got = [p for b in box for p in b]
        return [*got[1:], got[1]], {2}

    got = instructions.measure(_Uncounted(), (push, pop_all), batch=3, calls=2, size=64, who="ring")
    assert got == {"push": 0.0, "pop": 0.0}
    with pytest.raises(SystemExit, match="popped 5"):
        instructions.measure(_Uncounted(), (push, pop_one_short), batch=3, calls=2, size=64, who="ring")
    with pytest.raises(SystemExit, match="popped 7"):
        instructions.measure(_Uncounted(), (push, pop_one_more), batch=3, calls=2, size=64, who="ring")
    with pytest.raises(SystemExit, match="checksums differ"):
        instructions.measure(_Uncounted(), (push, pop_one_twice), batch=3, calls=2, size=64, who="ring")


def test_the_rows_layout_is_counted_by_default() -> None:
    """The ring of the rows layout is among the default designs, at most and at least once."""
    instructions = load_benchmark("instructions")
    assert instructions.parse_args([]).design == ["ring", "ring-rows", "table"]
    assert instructions.parse_args(["--semantics", "at-least-once"]).design == ["ring", "ring-rows", "table"]


def test_short_run_counts_with_the_horizon_held() -> None:
    """--hold both counts every design and the reference without the hold and then with it, in the
    same server: each row says whether it was held, a held row names the holder's xmin age (the hold
    was still open when its sessions ended: the script fails otherwise), and the naive queue's pop,
    whose deleted rows the hold keeps, costs more held (a count no higher would mean nothing was held).
    --rows-capacity makes the rows ring's pushes rotate segments once its sessions have pushed more rows
    than it holds (here 75 pushes into a ring of 64), and its rows say the capacity and the rotations."""
    require(None if shutil.which("valgrind") else "valgrind is not installed", "apt-get install valgrind")
    proc = subprocess.run(
        [
            *(sys.executable, str(INSTRUCTIONS_PY), "--design", "ring-rows", "--batch", "10"),
            *("--calls", "12", "--hold", "both", "--rows-capacity", "64", "--json"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    assert [(r["design"], r["hold"]) for r in rows] == [("ring-rows", False), ("ring-rows", True)]
    free, held = rows
    assert free["hold_xmin_age"] is None and held["hold_xmin_age"] > 0, rows
    assert {r["rows_capacity"] for r in rows} == {64}
    assert all(r["rows_rotations"] >= 1 for r in rows), rows
    for r in rows:
        for side in ("push", "pop"):
            assert r[f"{side}_instructions"] > 1000 and r[f"naive_{side}_instructions"] > 1000, (side, r)
    assert held["naive_pop_instructions"] > free["naive_pop_instructions"], rows


def test_hold_and_rows_capacity_arguments() -> None:
    instructions = load_benchmark("instructions")
    assert instructions.parse_args([]).hold == "no"
    assert instructions.parse_args(["--hold", "both"]).hold == "both"
    for bad in (["--rows-capacity", "60"], ["--rows-capacity", "66"], ["--hold", "maybe"]):
        with pytest.raises(SystemExit):
            instructions.parse_args(bad)
