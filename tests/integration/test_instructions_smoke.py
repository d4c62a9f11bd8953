"""Short version of benchmarks/instructions.py: server instructions a message of each design and of
the naive queue, counted by cachegrind in a PostgreSQL server of its own. No cost is asserted: only
that every side is counted, that the counts grow with the work (a longer session counts more), and
that the script's check of what went in and came out fails when a pop loses or adds a message."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.helpers import load_benchmark, require, run_benchmark

pytestmark = pytest.mark.integration


def counted(*args: str) -> list[dict[str, Any]]:
    """The rows of one run of the script (``--batch 10 --json`` and ``args``), which must succeed."""
    require(None if shutil.which("valgrind") else "valgrind is not installed", "apt-get install valgrind")
    rows: list[dict[str, Any]]
    [rows] = run_benchmark("instructions", "--batch", "10", "--json", *args)
    return rows


def assert_every_side_counted(r: dict[str, Any]) -> None:
    for prefix in ("", "naive_"):
        for side in ("push", "pop"):
            # a message costs the server thousands of instructions: a count near zero would mean
            # the sessions' backends were not the ones counted
            assert r[f"{prefix}{side}_instructions"] > 1000, (prefix, side, r)
        assert r[f"{prefix}cycle_instructions"] == pytest.approx(
            r[f"{prefix}push_instructions"] + r[f"{prefix}pop_instructions"], abs=1
        )


FEATURES_RUN = ["none", "dedup", "ttl", "ordering"]
"""The features of :func:`features_run`, in the order its rows come (ordering over 3 keys)."""


@pytest.fixture(scope="module")
def features_run() -> list[dict[str, Any]]:
    """One counted run of both designs, the rows ring and the table design, each with every feature
    (deduplication key, ttl, ordering over 3 keys) beside its default queue, each a queue of its own,
    with one call, and every queue created with the engine's default notify (auto; the script's default
    is never, which the other runs keep): the three tests below each look at their features' rows of
    it. One server and one naive reference serve them all (``tests/xdist_scheduling.py`` keeps this
    file on one worker, so that the run is made once); the slots ring's server count is the client
    run's below, which counts the server too."""
    rows = counted(
        *("--design", "ring-rows", "table", "--calls", "1", "--notify", "auto"),
        *("--feature", *FEATURES_RUN, "--ordering-keys", "3"),
    )
    # every row of the run, in order: a row missing from it would leave a test below without its rows
    assert [(r["design"], r["feature"], r["ordering_keys"]) for r in rows] == [
        (d, f, 3 if f == "ordering" else None) for d in ("ring-rows", "table") for f in FEATURES_RUN
    ]
    return rows


def test_short_run_counts_both_designs_and_each_feature_of_the_table_design(
    features_run: list[dict[str, Any]],
) -> None:
    """The rows ring, the table design and the naive queue, each design with a deduplication key and
    with a ttl (--feature), each a queue of its own: every row is counted, and a push with a
    deduplication key or a ttl costs more than the default queue's (a count no higher would mean the
    option was not sent)."""
    features = ["none", "dedup", "ttl"]
    rows = [r for r in features_run if r["feature"] in features]
    assert [(r["design"], r["feature"], r["ordering_keys"]) for r in rows] == [
        *(("ring-rows", f, None) for f in features),
        *(("table", f, None) for f in features),
    ]
    for r in rows:
        assert (r["batch"], r["reference"], r["semantics"], r["pooler"]) == (
            10,
            "naive",
            "at-most-once",
            "none",
        )
        assert_every_side_counted(r)
    for design in ("ring-rows", "table"):
        of = {r["feature"]: r for r in rows if r["design"] == design}
        for f in features[1:]:
            assert of[f]["push_instructions"] > of["none"]["push_instructions"], (design, f, rows)


def test_short_run_counts_ordering_keys_on_both_designs(features_run: list[dict[str, Any]]) -> None:
    """Each design ordered per key over 3 keys beside its default queue: a pop of 10 gets at most 3
    messages on the table design, and the pop session pops on until it has every message its push
    session sent (the script's check of what came out, counted and checksummed, fails otherwise); on
    the rows ring a push writes a row a lane. The ordered push costs more than the default one."""
    rows = [r for r in features_run if r["feature"] in ("none", "ordering")]
    assert [(r["design"], r["feature"], r["ordering_keys"]) for r in rows] == [
        ("ring-rows", "none", None),
        ("ring-rows", "ordering", 3),
        ("table", "none", None),
        ("table", "ordering", 3),
    ]
    for r in rows:
        assert r["semantics"] == "at-most-once"
        assert_every_side_counted(r)
    for plain, ordered in (rows[0:2], rows[2:4]):
        assert ordered["push_instructions"] > plain["push_instructions"], rows


def test_short_run_at_least_once_counts_the_table_design_and_ordering_against_pgmq() -> None:
    """At least once the pop sessions ack, and the reference is PGMQ's read and archive; ordered per key
    over 3 keys, the pop session pops and acks on until it has every message (as above)."""
    rows = counted(
        *("--design", "table", "--semantics", "at-least-once", "--archive", "--calls", "1"),
        *("--feature", "none", "ordering", "--ordering-keys", "3"),
    )
    assert [(r["feature"], r["ordering_keys"]) for r in rows] == [("none", None), ("ordering", 3)]
    for r in rows:
        assert (r["design"], r["reference"], r["semantics"], r["archive"]) == (
            "table",
            "pgmq",
            "at-least-once",
            True,
        )
        assert r["pop"] == "messages"
        assert_every_side_counted(r)
    assert rows[1]["push_instructions"] > rows[0]["push_instructions"], rows


def test_each_design_feature_and_number_of_keys_is_a_row_of_its_own() -> None:
    """The rows a batch counts: every design, the table design once a feature, the rows ring once a
    feature it has (all three), and ordering once a number of keys, in the order given."""
    instructions = load_benchmark("instructions")
    args = instructions.parse_args(
        ["--design", "ring", "table", "--feature", "none", "ordering", "ttl", "--ordering-keys", "3", "1000"]
    )
    assert instructions.variants(args) == [
        ("ring", "none", None),
        ("table", "none", None),
        ("table", "ordering", 3),
        ("table", "ordering", 1000),
        ("table", "ttl", None),
    ]
    args = instructions.parse_args(["--design", "ring-rows", "--feature", "none", "ordering", "dedup", "ttl"])
    assert instructions.variants(args) == [
        ("ring-rows", "none", None),
        ("ring-rows", "ordering", 1000),
        ("ring-rows", "dedup", None),
        ("ring-rows", "ttl", None),
    ]
    assert instructions.variants(instructions.parse_args([])) == [
        ("ring", "none", None),
        ("ring-rows", "none", None),
        ("table", "none", None),
    ]


def test_short_client_run_counts_the_client_of_the_ring_and_of_the_naive_queue() -> None:
    """--client runs every session in a Python of its own under cachegrind: the client's count of each
    side is there for the engine and for the naive queue, and grows with the work."""
    [r] = counted("--design", "ring", "--calls", "1", "--client")
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
    than it holds (here 75 pushes into a ring of 64), and its rows say the capacity and the rotations.
    Every side runs as it does behind a transaction pooler (--pooler transaction): nothing prepared."""
    rows = counted(
        *("--design", "ring-rows", "--calls", "12", "--hold", "both", "--rows-capacity", "64"),
        *("--pooler", "transaction"),
    )
    assert [(r["design"], r["hold"]) for r in rows] == [("ring-rows", False), ("ring-rows", True)]
    assert {r["pooler"] for r in rows} == {"transaction"}
    free, held = rows
    assert free["hold_xmin_age"] is None and held["hold_xmin_age"] > 0, rows
    assert {r["rows_capacity"] for r in rows} == {64}
    assert all(r["rows_rotations"] >= 1 for r in rows), rows
    for r in rows:
        assert_every_side_counted(r)
    assert held["naive_pop_instructions"] > free["naive_pop_instructions"], rows


def test_hold_and_rows_capacity_arguments() -> None:
    instructions = load_benchmark("instructions")
    assert instructions.parse_args([]).hold == "no"
    assert instructions.parse_args(["--hold", "both"]).hold == "both"
    for bad in (["--rows-capacity", "60"], ["--rows-capacity", "66"], ["--hold", "maybe"]):
        with pytest.raises(SystemExit):
            instructions.parse_args(bad)


def test_short_run_counts_the_table_design_with_the_engines_default_notify(
    features_run: list[dict[str, Any]],
) -> None:
    """--notify creates the queues with that setting (never unless told; the engine's default is auto):
    a run at auto (:func:`features_run`) counts every side of every row and says so in each row."""
    instructions = load_benchmark("instructions")
    assert instructions.parse_args([]).notify == "never"
    with pytest.raises(SystemExit):
        instructions.parse_args(["--notify", "sometimes"])
    assert [r["notify"] for r in features_run] == ["auto"] * len(features_run), features_run
    for r in features_run:
        assert_every_side_counted(r)
