"""Smoke test of benchmarks/run.py: a short run per semantics is valid and measures something.

No speed is asserted: only that the benchmark runs, checks its own correctness (nothing lost or
duplicated) and reports both the design's and the naive baseline's cycles per second; and that the
check it reports fails when a message is missing, duplicated or changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.helpers import checksum, load_benchmark, require
from tests.pgbouncer import find_pgbouncer

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


def test_short_ring_run_with_consumer_groups_is_valid(pg_dsn: str) -> None:
    """--groups 2: one consumer per group, each group gets every message once (the run's own per-group
    accounting), nothing is left in either group; --groups needs the ring. (about 5 s)"""
    proc = _run(
        pg_dsn,
        *("--design", "ring", "--producers", "1", "--consumers", "1", "--batch", "100", "--groups", "2"),
        *("--seconds", "1", "--warmup", "0.5", "--json", "--capacity", "2000"),
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert (point["design"], point["groups"], point["valid"]) == ("ring", 2, True)
    assert (point["lost"], point["duplicated"], point["left_in_queue"]) == (0, 0, 0)
    assert point["popped"] == 2 * point["pushed"] > 0 and point["cycles_per_s"] > 0
    refused = _run(pg_dsn, "--design", "table", "--groups", "2", "--seconds", "1")
    assert refused.returncode == 2 and "--groups" in refused.stderr


@pytest.mark.parametrize("design", ["table", "ring"])
def test_a_point_through_pgbouncer_in_transaction_mode_is_valid(pg_dsn: str, design: str) -> None:
    """--pooler transaction: both sides through a PgBouncer the run starts, the table design at least
    once with its maintenance loop beside it (which needs the server as its listen DSN)."""
    require(None if find_pgbouncer() else "pgbouncer is not installed", "apt-get install pgbouncer")
    # Maintenance every 0.2 s: at the default second, a run on a loaded machine ended its 1 s window
    # before the loop's first pass.
    extra = (
        ("--semantics", "at-least-once", "--with-maintenance", "--maintenance-interval", "0.2")
        if design == "table"
        else ()
    )
    proc = _run(
        pg_dsn,
        *("--design", design, "--producers", "1", "--consumers", "1", "--batch", "100", "--pooler"),
        *("transaction", "--seconds", "1", "--warmup", "0.5", "--json", *extra),
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert (point["design"], point["pooler"], point["valid"]) == (design, "transaction", True)
    assert (point["lost"], point["duplicated"], point["baseline_lost"], point["baseline_duplicated"]) == (
        0,
        0,
        0,
        0,
    )
    assert point["cycles_per_s"] > 0 and point["baseline_cycles_per_s"] > 0
    if design == "table":
        assert point["maintenance"]["runs"] >= 1, point["maintenance"]


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


def _one_point(pg_dsn: str, *args: str) -> dict[str, Any]:
    """A short 1x1 batch-100 point of the table design with ``args``; its JSON report."""
    proc = _run(
        pg_dsn,
        *("--design", "table", "--producers", "1", "--consumers", "1", "--batch", "100"),
        *("--warmup", "0.5", "--json", *args),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    return point


def test_a_point_with_maintenance_runs_it_beside_the_design_only(pg_dsn: str) -> None:
    """--with-maintenance: the table design's run has the maintenance process archiving what its
    at-least-once consumers acked; the naive and PGMQ references run as without it. Refused for a
    reference design and together with --maintenance; --reference-vacuum needs it. (about 15 s)"""
    point = _one_point(
        pg_dsn,
        *("--seconds", "4", "--semantics", "at-least-once", "--pgmq", "--with-maintenance"),
    )
    assert point["with_maintenance"] is True and point["valid"] is True
    assert (point["lost"], point["duplicated"], point["baseline_lost"], point["pgmq_lost"]) == (0, 0, 0, 0)
    assert point["cycles_per_s"] > 0 and point["baseline_cycles_per_s"] > 0 and point["pgmq_cycles_per_s"] > 0
    assert point["maintenance"]["runs"] >= 1 and point["maintenance"]["archived"] > 0
    assert point["reference_vacuum"] is False and "baseline_maintenance" not in point
    for refused in (("--design", "naive"), ("--maintenance",)):
        proc = _run(pg_dsn, *refused, "--with-maintenance", "--seconds", "1")
        assert proc.returncode == 2 and "--with-maintenance" in proc.stderr
    proc = _run(pg_dsn, "--reference-vacuum", "--seconds", "1")
    assert proc.returncode == 2 and "--reference-vacuum goes with --with-maintenance" in proc.stderr


def test_a_point_with_maintenance_can_vacuum_the_references_as_often(pg_dsn: str) -> None:
    """--reference-vacuum: the naive queue's run has a loop of VACUUM beside it too; with
    --no-maintenance-reindex the design's maintenance rebuilds nothing. (about 10 s)"""
    point = _one_point(
        pg_dsn,
        *("--seconds", "3", "--no-archive", "--with-maintenance", "--reference-vacuum"),
        "--no-maintenance-reindex",
    )
    assert (point["with_maintenance"], point["reference_vacuum"], point["valid"]) == (True, True, True)
    counts = ("lost", "duplicated", "baseline_lost", "baseline_duplicated")
    assert [point[k] for k in counts] == [0, 0, 0, 0]
    assert point["maintenance"]["runs"] >= 1 and point["baseline_maintenance"]["runs"] >= 1
    assert point["maintenance"]["reindexed"] == 0


HOLD_KEYS = (
    "cycles_per_s_first",
    "cycles_per_s_last",
    "bytes_before_hold",
    "bytes_in_hold",
    "bytes_after_release",
    "dead_tuples_in_hold",
    "dead_tuples_after_release",
    "pop_max_ms",
    "hold_xmin_age",
)


@pytest.mark.parametrize("design", ["ring", "table"])
def test_a_point_with_a_held_horizon_is_valid_and_the_hold_held(pg_dsn: str, design: str) -> None:
    """--hold-horizon 3: a REPEATABLE READ snapshot held over each design's 3 s window. Both runs are
    valid (nothing lost or duplicated), report the hold's figures for the design and the naive queue,
    and the hold held: its transaction was open at the end of the window with other transactions
    after it, and the naive queue's popped rows were still dead tuples there (no VACUUM or pruning
    could remove them). --seconds other than S is refused. (12 to 15 s each)"""
    proc = _run(
        pg_dsn,
        *("--design", design, "--producers", "1", "--consumers", "1", "--batch", "100"),
        *("--hold-horizon", "3", "--warmup", "0.5", "--no-archive", "--json"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert (point["design"], point["valid"], point["hold_horizon_s"], point["seconds"]) == (
        design,
        True,
        3,
        pytest.approx(3, abs=0.5),
    )
    counts = ("lost", "duplicated", "baseline_lost", "baseline_duplicated", "left_in_queue")
    assert [point[k] for k in counts] == [0] * len(counts)
    assert point["hold_edge_s"] == 1.5
    for prefix in ("", "baseline_"):
        for key in HOLD_KEYS:
            assert point[f"{prefix}{key}"] is not None, (prefix, key)
        assert point[f"{prefix}hold_held"] is True and point[f"{prefix}hold_xmin_age"] > 0
        assert point[f"{prefix}cycles_per_s_first"] > 0 and point[f"{prefix}cycles_per_s_last"] > 0
        assert len(point[f"{prefix}cycles_per_s_each_s"]) == 3
        assert point[f"{prefix}pop_max_ms"] > 0
    assert point["baseline_dead_tuples_in_hold"] > 0
    assert point["baseline_bytes_in_hold"] > point["baseline_bytes_before_hold"]
    refused = _run(pg_dsn, "--hold-horizon", "3", "--seconds", "2")
    assert refused.returncode == 2 and "--hold-horizon" in refused.stderr


def test_each_design_also_runs_unheld_in_every_round(pg_dsn: str) -> None:
    """--also-unheld with --hold-horizon 2 and two rounds: every design (the rows ring and the naive
    queue) runs without the hold and then with it in each round, four runs each, all counted and
    checksummed; the point reports each design's unheld rate and what it kept under the hold in each
    round (their ratio), and the held figures as before. Without --hold-horizon it is refused.
    (about 30 s)"""
    proc = _run(
        pg_dsn,
        *("--design", "ring-rows", "--producers", "1", "--consumers", "1", "--batch", "100"),
        *("--hold-horizon", "2", "--also-unheld", "--repeat", "2", "--warmup", "0.3", "--json"),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert (point["design"], point["valid"], point["hold_horizon_s"]) == ("ring-rows", True, 2)
    assert len(point["cycles_per_s_runs"]) == 2 and point["hold_held"] is True
    assert list(point["unheld"]) == ["ring-rows", "naive"]
    held_runs = {"ring-rows": point["cycles_per_s_runs"], "naive": point["baseline_cycles_per_s_runs"]}
    for design, f in point["unheld"].items():
        assert f["valid"] is True and (f["lost"], f["duplicated"], f["corrupt"]) == (0, 0, 0), f
        assert len(f["cycles_per_s_runs"]) == 2 and all(c > 0 for c in f["cycles_per_s_runs"]), f
        expected = [h / u for h, u in zip(held_runs[design], f["cycles_per_s_runs"], strict=True)]
        assert f["kept_runs"] == pytest.approx(expected, rel=0.01), (design, f)
        assert f["kept"] == pytest.approx(sorted(expected)[0] / 2 + sorted(expected)[1] / 2, rel=0.01)
    assert point["dead_tuples_in_hold"] == 0 and point["baseline_dead_tuples_in_hold"] > 0
    refused = _run(pg_dsn, "--also-unheld", "--seconds", "2")
    assert refused.returncode == 2 and "--also-unheld" in refused.stderr


def test_the_rows_layout_beside_the_others_in_one_run_paced_under_a_hold(pg_dsn: str) -> None:
    """--design ring-rows --also ring table, paced at 4,000 messages a second with a 3 s hold: the ring
    of the rows layout, the slots ring and the table design run in turn with the naive queue at the
    same point, each valid (counted and checksummed: nothing lost, duplicated, corrupted or left), each
    with the hold's figures, the rows ring made with its capacity in pushes and leaving no dead tuple
    where the slots ring leaves some; then a short point of the rows ring at least once, valid too.
    (about 45 s)"""
    proc = _run(
        pg_dsn,
        *("--design", "ring-rows", "--also", "ring", "table", "--producers", "2", "--consumers", "1"),
        *("--batch", "100", "--rate", "4000", "--hold-horizon", "3", "--warmup", "0.5", "--no-archive"),
        "--json",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert (point["design"], point["rate"], point["valid"]) == ("ring-rows", 4000, True)
    assert point["hold_horizon_s"] == 3
    # the backlog cap, 50 x batch x consumers, is 50 pushes; with 2 + 1 + 2 in flight, twice 55
    assert point["capacity"] == 112
    assert list(point["also"]) == ["ring", "table"]
    figures = [point, *point["also"].values()]
    for f in figures:
        assert f["valid"] is True and f["cycles_per_s"] > 0, f
        assert (f["lost"], f["duplicated"], f["corrupt"], f["left_in_queue"]) == (0, 0, 0, 0)
        assert f["cycles_per_s"] <= 1.1 * 4000
        for key in HOLD_KEYS:
            assert f[key] is not None, key
        assert f["hold_xmin_age"] > 0 and f["bytes_in_hold"] > 0
    assert point["also"]["ring"]["capacity"] > 5000 and point["also"]["table"]["capacity"] is None
    assert point["baseline_dead_tuples_in_hold"] > 0  # the hold held for the naive queue too
    # what tells the layouts apart: the rows ring's hot path left no dead row under the hold, the slots
    # ring's updated slots did
    assert point["dead_tuples_in_hold"] == 0 and point["also"]["ring"]["dead_tuples_in_hold"] > 0
    leased = _run(
        pg_dsn,
        *("--design", "ring-rows", "--semantics", "at-least-once", "--producers", "1", "--consumers", "1"),
        *("--batch", "50", "--seconds", "1", "--warmup", "0.2", "--json"),
        timeout=120,
    )
    assert leased.returncode == 0, leased.stderr
    [line] = [line for line in leased.stdout.splitlines() if line.strip()]
    point = json.loads(line)
    assert (point["design"], point["valid"]) == ("ring-rows", True), point
    assert point["semantics"] == "at-least-once"
    assert (point["lost"], point["duplicated"], point["corrupt"], point["left_in_queue"]) == (0, 0, 0, 0)
    assert point["cycles_per_s"] > 0


def test_a_paced_point_pushes_at_its_rate(pg_dsn: str) -> None:
    """--rate 4000: two producers together push about 4,000 messages a second (each a batch of 100
    every 50 ms), and the consumer keeps up; a rate that is not positive is refused. (about 13 s)"""
    proc = _run(
        pg_dsn,
        *("--design", "ring", "--producers", "2", "--consumers", "1", "--batch", "100", "--rate", "4000"),
        *("--seconds", "2", "--warmup", "0.5", "--json"),
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert (point["rate"], point["valid"]) == (4000, True)
    assert 0.7 * 4000 <= point["pushed_per_s"] <= 1.1 * 4000, point["pushed_per_s"]
    assert point["cycles_per_s"] <= 1.1 * 4000 and point["baseline_cycles_per_s"] <= 1.1 * 4000
    refused = _run(pg_dsn, "--rate", "0", "--seconds", "1")
    assert refused.returncode == 2 and "--rate must be > 0" in refused.stderr


def _payload(run: ModuleType, producer: int, seq: int, size: int = 300) -> bytes:
    """A payload as run.py's producers make it: (producer, seq), then its filler from the pool."""
    return bytes(run.HEADER.pack(producer, seq) + run.Fillers(size, run.HEADER.size).pick(producer, seq))


def _report(run: ModuleType, *batches: list[bytes], producers: int = 2) -> dict[str, Any]:
    """A consumer's report after popping ``batches``, through run.py's own Received."""
    got = run.Received(producers, 300)
    for batch in batches:
        got.add(batch)
    return {"bitmaps": [bytes(b) for b in got.bitmaps], "local_dups": got.dups, "corrupt": got.corrupt}


def _result(run: ModuleType, **counts: int) -> Any:
    """A RunResult whose correctness counts are ``counts`` (zero otherwise)."""
    fields = dataclasses.fields(run.RunResult)
    base = {f.name: 0 for f in fields if f.default is dataclasses.MISSING}
    return run.RunResult(**{**base, "design": "table", "hot_update_ratio": None, **counts})


def test_run_check_counts_a_lost_a_duplicated_and_a_corrupt_message() -> None:
    """run.py's own accounting (what test_short_run_is_valid trusts): fed a missing, a duplicated and a
    changed message, it counts each, and the run is not valid."""
    run = load_benchmark("run")
    p0 = [_payload(run, 0, s) for s in range(6)]
    p1 = [_payload(run, 1, s) for s in range(4)]
    whole = [_report(run, p0[:3], p1), _report(run, p0[3:])]
    assert run.count_deliveries([6, 4], whole) == (0, 0, 0)
    assert _result(run).valid

    missing = [_report(run, p0[:3], p1), _report(run, p0[3:5])]  # producer 0's seq 5 never came
    assert run.count_deliveries([6, 4], missing) == (1, 0, 0)
    twice_across = [_report(run, p0[:4], p1), _report(run, p0[3:])]  # seq 3 to both consumers
    assert run.count_deliveries([6, 4], twice_across) == (0, 1, 0)
    twice_here = [_report(run, p0[:3], p1, [p1[2]]), _report(run, p0[3:])]  # one consumer got it twice
    assert run.count_deliveries([6, 4], twice_here) == (0, 1, 0)
    changed = bytearray(p0[4])
    changed[-1] ^= 1
    corrupt = [_report(run, p0[:4], [bytes(changed)], p0[5:], p1), _report(run)]
    assert run.count_deliveries([6, 4], corrupt) == (1, 0, 1)  # seq 4 not received, and one corrupt
    unpushed = [_report(run, p0, p1, [_payload(run, 1, 9)])]  # a number producer 1 never pushed
    assert run.count_deliveries([6, 4], unpushed) == (0, 0, 1)

    for counts in ({"lost": 1}, {"duplicated": 1}, {"corrupt": 1}, {"left_in_queue": 1}):
        assert not _result(run, **counts).valid, counts
        assert not run.combine([_result(run), _result(run, **counts)]).valid, counts


def test_a_point_with_each_feature_of_the_table_design_in_one_run(pg_dsn: str) -> None:
    """--feature measures the table design's push options, each a queue of its own in the same run as
    the default queue and the naive queue: every run valid (what went in came out once, unchanged), and
    each feature's cycles/s put against the default queue's."""
    features = ["ordering:3", "ordering:1000", "dedup", "ttl"]
    proc = _run(
        pg_dsn,
        *("--design", "table", "--producers", "1", "--consumers", "1", "--batch", "20"),
        *("--seconds", "1", "--warmup", "0.2", "--json", "--semantics", "at-least-once"),
        *("--feature", *features),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.strip()]
    point: dict[str, Any] = json.loads(line)
    assert point["valid"] is True and list(point["features"]) == features
    for name, f in point["features"].items():
        assert (f["lost"], f["duplicated"], f["corrupt"], f["left_in_queue"]) == (0, 0, 0, 0), name
        assert f["valid"] is True and f["popped"] >= f["pushed"] > 0, (name, f)
        # against the default queue's cycles/s (both reported rounded to 0.1)
        assert f["ratio_to_table"] == pytest.approx(f["cycles_per_s"] / point["cycles_per_s"], abs=0.002), (
            name,
            f,
        )


@pytest.mark.parametrize("bad", ["ordering:0", "dedup:3", "keys"])
def test_a_feature_that_is_not_one_is_refused(pg_dsn: str, bad: str) -> None:
    proc = _run(pg_dsn, "--design", "table", "--producers", "1", "--seconds", "1", "--feature", bad)
    assert proc.returncode == 2 and "--feature" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_a_feature_queue_is_made_and_pushed_to_with_its_option(pg_dsn: str) -> None:
    """What run.py's workers do on a feature's queue (bench.backends): the queue is created for it, and
    every push carries it. Ordering over 2 keys: a pop at least once of all 8 pushed takes only the 2
    heads; deduplication: every message has its key in the queue's window (the same push again adds
    nothing); ttl: every message expires (the queue's default, an hour)."""
    load_benchmark("run")  # puts bench on the path of the modules it imports
    backends = sys.modules["bench.backends"]
    for feature, keys in (("ordering", 2), ("dedup", 0), ("ttl", 0)):
        target = backends.Target(
            design="table",
            dsn=pg_dsn,
            schema=f"bench_feat_{feature}",
            semantics="at-least-once",
            archive=False,
            notify="never",
            feature=feature,
            ordering_keys=keys,
        )
        backends.setup_target(target)
        try:
            producer = backends.open_backend(target, "producer")
            sent = [f"m{i}".encode() for i in range(8)]
            producer.push(sent)
            with target.engine(1) as dbq:
                q = dbq.queue(backends.QUEUE_NAME)
                st = q.stats()
                assert st.ready == 8, (feature, st)
                if feature == "ordering":
                    first = q.pop(10, semantics="at-least-once")
                    # m0 and m1 name the two keys; m2..m7 wait behind them
                    assert sorted(m.payload for m in first) == [b"m0", b"m1"], (feature, first)
                    q.ack(first)
                elif feature == "dedup":
                    producer.sent = 0  # the same keys again: the window returns the first pushes' ids
                    producer.push(sent)
                    assert q.stats().ready == 8
                else:
                    assert q.settings.ttl_s == 3600.0
                    with psycopg.connect(pg_dsn) as c:
                        n = c.execute(
                            "SELECT count(*) FROM bench_feat_ttl.meta_opt WHERE expires_at IS NOT NULL"
                        ).fetchone()
                    assert n == (8,)
                got = []
                while batch := q.pop(10, semantics="at-most-once"):
                    got.extend(m.payload for m in batch)
                if feature == "ordering":
                    got += [m.payload for m in first]
                texts = [p.decode() for p in got]
                assert len(got) == len(sent) and checksum(texts) == checksum(p.decode() for p in sent), (
                    feature
                )
            producer.close()
        finally:
            backends.teardown_target(target)
