#!/usr/bin/env python
"""Benchmark: full push-then-pop cycles per second of a queue design, against the naive baseline.

    python benchmarks/run.py --design {table,ring,ring-rows,naive} --producers P --consumers C \
        --batch N --seconds S [--json] [--semantics {at-most-once,at-least-once}] [--payload-bytes 300] \
        [--also DESIGN ...]

    python benchmarks/run.py --maintenance [--producers P --consumers C --batch N --seconds S]

With none of --producers/--consumers/--batch it sweeps P x C in 1x1, 2x2, 4x4, 8x8 and batch in
1, 100, 1000. Every point measures the chosen design and, in the same run, the naive baseline (one
table, INSERT to push, DELETE ... FOR UPDATE SKIP LOCKED ... RETURNING to pop) at the same P x C x
batch, each on a fresh schema that is dropped afterwards; ``--also`` adds engine designs measured in
the same run, in turn with the others (their figures under ``also`` in the point's JSON). The ``ring``
design is the ring's slots layout, ``ring-rows`` its rows layout (PostgreSQL only; its capacity
counted in pushes). Producers and consumers are separate
processes with a connection each. Every run checks that no message was lost or delivered twice.
With ``--maintenance`` it measures the engine design at one point twice in the same run, without and with
a maintenance process looping (archiving, VACUUM, online index rebuilds), and prints push/pop/ack latency
percentiles (p50/p95/p99) of both with their ratios. With ``--hold-horizon S`` every design's window
lasts S seconds under a held xmin horizon (a REPEATABLE READ snapshot on a session of its own), and the
point reports how each design's speed, size and dead tuples went meanwhile and after; ``--also-unheld``
adds, in every round, each design's run without the hold just before its held one, and reports the rate
each kept under the hold against its own unheld rate of the same round. See
benchmarks/README.md for what the columns mean.

The database is ``--dsn``, else ``$DBQUEUE_TEST_DSN``, else a throwaway embedded PostgreSQL.

This script holds the command line, the points and the reports; the queues it measures, the worker
processes and one run of one design are in the ``bench`` package beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from bench.backends import (
    ALL_DESIGNS,
    BASELINE,
    ENGINE_DESIGNS,
    PGMQ,
    REFERENCES,
    RING_ROWS,
    Target,
    split_feature,
)
from bench.measure import HOLD_KEYS, BenchError, RunResult, combine, percentile, run_design
from bench.report import (
    LATENCY_OPS,
    PERCENTILES,
    also_lines,
    hold_table,
    maintenance_table,
    rounded,
    table_header,
    table_row,
    unheld_lines,
)

# Fillers, Received and count_deliveries: run.py's accounting, which
# tests/integration/test_benchmark_smoke.py checks through this module
from bench.workers import HEADER, Fillers, Received, count_deliveries  # noqa: F401

from airflow_dbqueue.engine import DbQueueError, MaintenanceConfig

TEST_DSN_ENV = "DBQUEUE_TEST_DSN"
SEMANTICS = ("at-most-once", "at-least-once")

SWEEP_PAIRS = ((1, 1), (2, 2), (4, 4), (8, 8))
SWEEP_BATCHES = (1, 100, 1000)


class DesignNotAvailable(BenchError):
    """The requested design is not implemented yet."""


def check_design(design: str) -> None:
    """Raise :class:`DesignNotAvailable` unless ``design`` can be measured."""
    if design in REFERENCES or design in ENGINE_DESIGNS:
        return
    raise DesignNotAvailable(
        f"the {design} design is not available yet: the engine implements only the "
        f"{' and '.join(ENGINE_DESIGNS)} design so far; run with --design table (or --design naive)"
    )


# -- points, output, main --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    producers: int
    consumers: int
    batch: int


def plan(producers: int | None, consumers: int | None, batch: int | None) -> list[Point]:
    """The points to measure: every dimension not given on the command line is swept."""
    if producers is None and consumers is None:
        pairs: list[tuple[int, int]] = list(SWEEP_PAIRS)
    else:
        p = producers or consumers
        c = consumers or producers
        assert p is not None and c is not None
        pairs = [(p, c)]
    batches = list(SWEEP_BATCHES) if batch is None else [batch]
    return [Point(p, c, b) for p, c in pairs for b in batches]


def _logger(args: argparse.Namespace) -> Callable[[str], None]:
    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    return log


def backlog_cap(args: argparse.Namespace, point: Point) -> int:
    """Messages queued at most before producers pause (``--backlog-cap``, else from the point)."""
    return int(args.backlog_cap or max(1000, 50 * point.batch * point.consumers))


def ring_capacity(args: argparse.Namespace, point: Point, cap: int) -> int:
    """``--capacity``, else a ring big enough for the backlog and every batch in flight: the bench
    measures flow, not a full ring pushing back (--capacity makes it smaller to measure that)."""
    return int(args.capacity or cap + (point.producers + point.consumers * args.groups + 2) * point.batch)


def rows_capacity(args: argparse.Namespace, point: Point, cap: int) -> int:
    """Pushes a ring of the rows layout holds: ``--rows-capacity``, else room for twice the pushes of
    the backlog and those in flight (a segment is emptied only once every lane has passed it, so the
    rows held span up to two segments more than they fill), in four segments of at least two rows a
    lane (the layout's floor, with its default 8 lanes: 64)."""
    if args.rows_capacity:
        return int(args.rows_capacity)
    pushes = -(-cap // point.batch) + point.producers + point.consumers + 2
    return max(64, 4 * -(-2 * pushes // 4))


def capacity_of(args: argparse.Namespace, design: str, point: Point, cap: int) -> int | None:
    """The capacity a design's queue is made with at ``point``: slots of a ring, pushes of a rows ring,
    none for the others."""
    if design == "ring":
        return ring_capacity(args, point, cap)
    if design == RING_ROWS:
        return rows_capacity(args, point, cap)
    return None


def make_target(args: argparse.Namespace, dsn: str, design: str, point: Point, cap: int) -> Target:
    """A fresh schema's queue of ``design`` for one run at ``point`` (``table+FEATURE``: the table
    design's queue with that push option on every message, see --feature)."""
    design, feature, keys = split_feature(design)
    return Target(
        design=design,
        feature=feature,
        ordering_keys=keys,
        schema=f"bench_{design.replace('-', '_')}_{uuid.uuid4().hex[:10]}",
        semantics=args.semantics,
        archive=args.archive,
        notify=args.notify,
        capacity=capacity_of(args, design, point, cap),
        payload_bytes=args.payload_bytes,
        pop_api=args.pop,
        groups=args.groups if design == "ring" else 1,
        pooler=args.pooler,
        dsn=args.pooler_dsn or dsn,
        server_dsn=dsn,
        recycle_interval=args.engine_recycle_interval or None,
    )


def measure_point(args: argparse.Namespace, dsn: str, point: Point, seconds: float) -> dict[str, Any]:
    """Measure the design and the naive baseline at one point; return the point's report."""

    log = _logger(args)
    cap = backlog_cap(args, point)
    designs = [args.design] + [d for d in args.also if d != args.design]
    designs += [f"table+{f}" for f in args.feature]
    if args.design != BASELINE:
        designs.append(BASELINE)
    if args.pgmq and args.design not in REFERENCES:
        designs.append(PGMQ)
    runs: dict[str, list[RunResult]] = {d: [] for d in designs}
    # --also-unheld: each design's run without the hold, just before its held run of the same round
    unheld: dict[str, list[RunResult]] = {d: [] for d in designs}
    # --with-maintenance: the engine design's runs have the maintenance process looping beside them;
    # the references keep autovacuum at its defaults, or with --reference-vacuum get a loop of VACUUM
    # of their tables at the same interval.
    # --recycle-interval: the table design's runs have a process running only its partition recycling
    # (Maintenance.recycle) every S seconds beside them, also under --hold-horizon; the references keep
    # autovacuum at its defaults.
    config = maintenance_config(args) if args.with_maintenance else None
    recycling = MaintenanceConfig() if args.recycle_interval else None
    maintenance_of = loop_of(args, config, recycling)

    holds = [False, True] if args.also_unheld else [args.hold_horizon > 0]
    for attempt in range(args.repeat):
        for design, hold in itertools.product(designs, holds):
            target = make_target(args, dsn, design, point, cap)
            which = f" (run {attempt + 1} of {args.repeat})" if args.repeat > 1 else ""
            held = " with the horizon held" if hold else " without a hold" if args.also_unheld else ""
            log(
                f"measuring {design} {args.semantics} {point.producers}x{point.consumers} "
                f"batch {point.batch} for {seconds:g}s{held}{which}"
            )
            run = run_design(
                target,
                producers=point.producers,
                consumers=point.consumers,
                batch=point.batch,
                payload_bytes=args.payload_bytes,
                seconds=seconds,
                warmup=args.warmup,
                backlog_cap=cap,
                drain_timeout=args.drain_timeout,
                log=log,
                maintenance=maintenance_of(design),
                maintenance_interval=args.recycle_interval or args.maintenance_interval,
                hold=hold,
                rate=args.rate,
                recycle_only=recycling is not None,
            )
            (runs if hold or not args.also_unheld else unheld)[design].append(run)
            log(
                f"  {design}: {run.cycles_per_s:,.0f} cycles/s, lost {run.lost}, "
                f"duplicated {run.duplicated}, corrupt {run.corrupt}"
            )
    main_run, base = combine(runs[args.design]), combine(runs[BASELINE])
    out: dict[str, Any] = {
        "design": args.design,
        "semantics": args.semantics,
        "pop": args.pop if args.semantics == "at-most-once" else "messages",
        "producers": point.producers,
        "consumers": point.consumers,
        "batch": point.batch,
        "payload_bytes": args.payload_bytes,
        "seconds": main_run.seconds,
        "cycles_per_s": round(main_run.cycles_per_s, 1),
        "baseline_cycles_per_s": round(base.cycles_per_s, 1),
        "ratio": round(main_run.cycles_per_s / base.cycles_per_s, 3) if base.cycles_per_s else None,
        "lost": main_run.lost,
        "duplicated": main_run.duplicated,
        "table_bytes": main_run.table_bytes,
        "table_bytes_start": main_run.table_bytes_start,
        "dead_tuples": main_run.dead_tuples,
        "hot_update_ratio": rounded(main_run.hot_update_ratio, 3),
        "wal_bytes_per_msg": rounded(main_run.wal_bytes_per_msg, 1),
        "pushed_per_s": round(main_run.pushed_per_s, 1),
        "pushed": main_run.pushed,
        "popped": main_run.popped,
        "corrupt": main_run.corrupt,
        "ack_failures": main_run.ack_failures,
        "left_in_queue": main_run.left_in_queue,
        "backlog_at_end": main_run.backlog_at_end,
        "push_ms": rounded(main_run.push_ms, 3),
        "pop_ms": rounded(main_run.pop_ms, 3),
        "ack_ms": rounded(main_run.ack_ms, 3),
        "empty_pops": main_run.empty_pops,
        "backlog_cap": cap,
        "warmup_s": args.warmup,
        "archive": args.archive if args.design == "table" else None,
        "capacity": capacity_of(args, args.design, point, cap),
        "groups": args.groups if args.design == "ring" else None,
        "notify": args.notify if args.design not in REFERENCES else None,
        "with_maintenance": config is not None,
        "reference_vacuum": config is not None and args.reference_vacuum,
        "recycle_interval_s": args.recycle_interval or None,
        "engine_recycle_interval_s": args.engine_recycle_interval or None,
    }
    out.update(loop_report(args, runs, config, recycling))
    if PGMQ in designs and args.design != PGMQ:
        pgmq = combine(runs[PGMQ])
        out["pgmq_cycles_per_s"] = round(pgmq.cycles_per_s, 1)
        out["pgmq_ratio"] = round(main_run.cycles_per_s / pgmq.cycles_per_s, 3) if pgmq.cycles_per_s else None
        out["pgmq_lost"], out["pgmq_duplicated"] = pgmq.lost, pgmq.duplicated
        out["pgmq_wal_bytes_per_msg"] = rounded(pgmq.wal_bytes_per_msg, 1)
        if args.repeat > 1:
            out["pgmq_cycles_per_s_runs"] = [round(r.cycles_per_s, 1) for r in runs[PGMQ]]
    for key in (
        "lost",
        "duplicated",
        "corrupt",
        "table_bytes",
        "dead_tuples",
        "wal_bytes_per_msg",
        "left_in_queue",
        "push_ms",
        "pop_ms",
        "ack_ms",
    ):
        out[f"baseline_{key}"] = rounded(getattr(base, key), 3)
    if args.repeat > 1:
        out["cycles_per_s_runs"] = [round(r.cycles_per_s, 1) for r in runs[args.design]]
        out["baseline_cycles_per_s_runs"] = [round(r.cycles_per_s, 1) for r in runs[BASELINE]]
    if args.rate:
        out["rate"] = args.rate
    if args.hold_horizon > 0:
        out.update(hold_report(args, runs))
    if args.also_unheld:
        out["unheld"] = {d: unheld_report(runs[d], unheld[d]) for d in designs}
    out.update(beside_reports(args, runs, main_run, point, cap))
    out["valid"] = all(combine(rs).valid for rs in [*runs.values(), *(r for r in unheld.values() if r)])
    return out


def beside_reports(
    args: argparse.Namespace, runs: dict[str, list[RunResult]], main_run: RunResult, point: Point, cap: int
) -> dict[str, Any]:
    """The figures of what ran beside the design at the point: ``--also``'s designs and ``--feature``'s
    queues, each under its key (none when neither was asked for)."""
    out: dict[str, Any] = {}
    also = [d for d in args.also if d != args.design]
    if also:
        out["also"] = {d: also_report(args, runs, d, capacity_of(args, d, point, cap)) for d in also}
    if args.feature:
        out["features"] = feature_report(args, runs, main_run)
    return out


def unheld_report(held: list[RunResult], unheld: list[RunResult]) -> dict[str, Any]:
    """``--also-unheld``: one design's rate without the hold (its median run) and what it kept under the
    hold: the median of each round's held over unheld rate, with every round's ratio, and what the
    unheld runs lost, duplicated or corrupted."""
    r = combine(unheld)
    kept = [h.cycles_per_s / u.cycles_per_s for h, u in zip(held, unheld, strict=True) if u.cycles_per_s]
    return {
        "cycles_per_s": round(r.cycles_per_s, 1),
        "cycles_per_s_runs": [round(u.cycles_per_s, 1) for u in unheld],
        "kept": round(statistics.median(kept), 3) if kept else None,
        "kept_runs": [round(k, 3) for k in kept],
        "lost": r.lost,
        "duplicated": r.duplicated,
        "corrupt": r.corrupt,
        "valid": r.valid,
    }


def also_report(
    args: argparse.Namespace, runs: dict[str, list[RunResult]], design: str, capacity: int | None
) -> dict[str, Any]:
    """``--also``: one more design's figures at the point (its median run, with every run's counts of
    what was lost, duplicated or corrupted added up), under the names the point uses for its design."""
    r, base = combine(runs[design]), combine(runs[BASELINE])
    out: dict[str, Any] = {
        "cycles_per_s": round(r.cycles_per_s, 1),
        "ratio": round(r.cycles_per_s / base.cycles_per_s, 3) if base.cycles_per_s else None,
        "capacity": capacity,
        "valid": r.valid,
    }
    for key in (
        "lost",
        "duplicated",
        "corrupt",
        "ack_failures",
        "left_in_queue",
        "pushed",
        "popped",
        "table_bytes",
        "table_bytes_start",
        "dead_tuples",
        "hot_update_ratio",
        "wal_bytes_per_msg",
        "push_ms",
        "pop_ms",
    ):
        out[key] = rounded(getattr(r, key), 3)
    if args.repeat > 1:
        out["cycles_per_s_runs"] = [round(x.cycles_per_s, 1) for x in runs[design]]
    if args.hold_horizon > 0:
        hold = r.hold or {}
        out.update({key: hold.get(key) for key in HOLD_KEYS})
    return out


def feature_report(
    args: argparse.Namespace, runs: dict[str, list[RunResult]], table: RunResult
) -> dict[str, Any]:
    """``--feature``: each feature's queue as ``also_report`` gives a design, with its cycles/s against
    the default queue's (``table``, the same runs' median of --design table) as ``ratio_to_table``."""
    out: dict[str, Any] = {}
    for f in args.feature:
        fr = also_report(args, runs, f"table+{f}", None)
        fr["ratio_to_table"] = (
            round(fr["cycles_per_s"] / table.cycles_per_s, 3) if table.cycles_per_s else None
        )
        out[f] = fr
    return out


def hold_report(args: argparse.Namespace, runs: dict[str, list[RunResult]]) -> dict[str, Any]:
    """``--hold-horizon``: the hold's figures of each design's (median) run, under the prefix of its
    other figures ("" for the design, ``baseline_`` for the naive queue, ``pgmq_`` for PGMQ)."""
    out: dict[str, Any] = {"hold_horizon_s": args.hold_horizon}
    prefixes = [("", args.design), ("baseline_", BASELINE)]
    if PGMQ in runs and args.design != PGMQ:
        prefixes.append(("pgmq_", PGMQ))
    for prefix, design in prefixes:
        hold = combine(runs[design]).hold or {}
        out["hold_edge_s"] = hold.get("edge_s")
        for key in HOLD_KEYS:
            out[f"{prefix}{key}"] = hold.get(key)
    return out


def loop_of(
    args: argparse.Namespace, config: MaintenanceConfig | None, recycling: MaintenanceConfig | None
) -> Callable[[str], MaintenanceConfig | None]:
    """What loops beside a design's runs: the recycling (the engine design only), else maintenance
    (the engine design, and the references with --reference-vacuum), else nothing."""

    def of(design: str) -> MaintenanceConfig | None:
        if recycling is not None:
            return recycling if design == args.design else None
        return config if design == args.design or args.reference_vacuum else None

    return of


def loop_report(
    args: argparse.Namespace,
    runs: dict[str, list[RunResult]],
    config: MaintenanceConfig | None,
    recycling: MaintenanceConfig | None,
) -> dict[str, Any]:
    """What the loops beside the runs did (--with-maintenance, --recycle-interval), summed."""
    out: dict[str, Any] = {}
    if config is not None:
        out["maintenance_interval_s"] = args.maintenance_interval
        out["maintenance"] = maintenance_totals(runs[args.design])
        if args.reference_vacuum:
            out["baseline_maintenance"] = maintenance_totals(runs[BASELINE])
            if PGMQ in runs:
                out["pgmq_maintenance"] = maintenance_totals(runs[PGMQ])
    if recycling is not None:
        out["recycling"] = maintenance_totals(runs[args.design])
    return out


def maintenance_config(args: argparse.Namespace) -> MaintenanceConfig:
    """What the maintenance process runs in a loop: archive everything finished, VACUUM, rebuild bloated
    indexes (from 256 KiB of bloat, so rebuilds happen within a short window; not with
    --no-maintenance-reindex)."""
    return MaintenanceConfig(
        archive_after_s=args.archive_after,
        archive_retention_s=None,
        batch_size=1000,
        pause_s=0.05,
        time_budget_s=max(1.0, args.maintenance_interval),
        vacuum=True,
        reindex=args.maintenance_reindex,
        reindex_bloat_ratio=2.0,
        reindex_min_bytes=256 * 1024,
        reindex_timeout_s=60.0,
    )


def maintenance_totals(runs: list[RunResult]) -> dict[str, Any]:
    """What the maintenance process did over ``runs``, summed."""
    totals: dict[str, Any] = {}
    for r in runs:
        for k, v in (r.maintenance or {}).items():
            totals[k] = totals.get(k, 0) + v
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()}


def measure_maintenance_point(
    args: argparse.Namespace, dsn: str, point: Point, seconds: float
) -> dict[str, Any]:
    """Measure the engine design at one point without and with maintenance running, in turn."""

    log = _logger(args)
    cap = backlog_cap(args, point)
    config = maintenance_config(args)
    runs: dict[str, list[RunResult]] = {"off": [], "on": []}
    for attempt in range(args.repeat):
        for mode in ("off", "on"):
            target = make_target(args, dsn, args.design, point, cap)
            which = f" (run {attempt + 1} of {args.repeat})" if args.repeat > 1 else ""
            log(
                f"measuring {args.design} {args.semantics} {point.producers}x{point.consumers} "
                f"batch {point.batch} for {seconds:g}s, maintenance {mode}{which}"
            )
            run = run_design(
                target,
                producers=point.producers,
                consumers=point.consumers,
                batch=point.batch,
                payload_bytes=args.payload_bytes,
                seconds=seconds,
                warmup=args.warmup,
                backlog_cap=cap,
                drain_timeout=args.drain_timeout,
                log=log,
                latencies=True,
                maintenance=config if mode == "on" else None,
                maintenance_interval=args.maintenance_interval,
            )
            runs[mode].append(run)
            log(f"  {mode}: {run.cycles_per_s:,.0f} cycles/s, lost {run.lost}, duplicated {run.duplicated}")
    out: dict[str, Any] = {
        "mode": "maintenance",
        "design": args.design,
        "semantics": args.semantics,
        "pop": args.pop if args.semantics == "at-most-once" else "messages",
        "producers": point.producers,
        "consumers": point.consumers,
        "batch": point.batch,
        "payload_bytes": args.payload_bytes,
        "seconds": seconds,
        "runs_per_mode": args.repeat,
        "maintenance_interval_s": args.maintenance_interval,
        "maintenance_config": dataclasses.asdict(config),
    }
    for mode, rs in runs.items():
        out[f"cycles_per_s_{mode}"] = round(statistics.median(r.cycles_per_s for r in rs), 1)
        out[f"hot_bytes_{mode}"] = max(r.hot_bytes or 0 for r in rs)
        out[f"table_bytes_{mode}"] = max(r.table_bytes for r in rs)
        for op in LATENCY_OPS:
            values = [v for r in rs for v in r.latencies.get(op, [])]
            out[f"{op}_calls_{mode}"] = len(values)
            for pct in PERCENTILES:
                v = percentile(values, pct)
                out[f"{op}_p{pct}_ms_{mode}"] = None if v is None else round(1000 * v, 3)
    for op in LATENCY_OPS:
        for pct in PERCENTILES:
            off, on = out[f"{op}_p{pct}_ms_off"], out[f"{op}_p{pct}_ms_on"]
            out[f"{op}_p{pct}_ratio"] = round(on / off, 3) if off and on is not None else None
    off_cps = out["cycles_per_s_off"]
    out["cycles_ratio"] = round(out["cycles_per_s_on"] / off_cps, 3) if off_cps else None
    out["maintenance"] = maintenance_totals(runs["on"])
    all_runs = runs["off"] + runs["on"]
    out["lost"] = sum(r.lost for r in all_runs)
    out["duplicated"] = sum(r.duplicated for r in all_runs)
    out["valid"] = all(r.valid for r in all_runs)
    return out


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[tuple[str, str]]:
    """Yield ``(dsn, where)``: the given server, or a throwaway embedded one stopped on exit."""
    dsn = dsn or os.environ.get(TEST_DSN_ENV)
    if dsn:
        yield dsn, "given"
        return
    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

    tmp = Path(tempfile.mkdtemp(prefix="dbqueue-bench-pg-"))
    server = EmbeddedPostgres(tmp / "data")
    try:
        yield server.start(), "embedded, throwaway"
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def pooler(args: argparse.Namespace, dsn: str) -> Iterator[str]:
    """With ``--pooler``, run a PgBouncer in that mode in front of ``dsn`` for the whole run (the
    tests' launcher, tests/pgbouncer.py) and point the workers at it; yield what the header says."""
    if args.pooler == "none":
        yield ""
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.pgbouncer import PgBouncer, find_pgbouncer

    binary = find_pgbouncer()
    if binary is None:
        raise BenchError("--pooler needs pgbouncer (apt-get install pgbouncer)")
    bouncer = PgBouncer(dsn, binary)
    bouncer.start()
    args.pooler_dsn = bouncer.dsn(args.pooler)
    try:
        yield f" | through PgBouncer, {args.pooler} mode"
    finally:
        args.pooler_dsn = None
        bouncer.stop()


def server_info(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        names = ("server_version", "shared_buffers", "synchronous_commit", "fsync", "max_wal_size")
        return {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]


def add_load_options(ap: argparse.ArgumentParser) -> None:
    """--rate and --hold-horizon: what the run's load is, beside the point."""
    ap.add_argument(
        "--rate",
        type=float,
        help="messages a second all producers together push at most (default: as fast as they can)",
    )
    ap.add_argument(
        "--hold-horizon",
        type=float,
        default=0.0,
        metavar="S",
        help="hold the xmin horizon (a REPEATABLE READ transaction with a snapshot, on a session of its "
        "own) over a measured window of S seconds in every design's run, and report what it did: "
        "cycles/s in the first and last 10 s, sizes and dead tuples before, during and after it, the "
        "longest pop (default 0: no hold)",
    )
    ap.add_argument(
        "--also-unheld",
        action="store_true",
        help="with --hold-horizon: every round also runs each design without the hold, just before its "
        "held run, and reports the rate each kept under the hold against its own unheld rate of the same "
        "round (the median of the rounds' ratios)",
    )


def intervals(ap: argparse.ArgumentParser) -> None:
    """The options of what runs in a loop beside an engine design's workers."""
    ap.add_argument(
        "--maintenance-interval", type=float, default=1.0, help="seconds between maintenance runs"
    )
    ap.add_argument(
        "--recycle-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="the table design's runs have a process running only its partition recycling "
        "(Maintenance.recycle: TRUNCATE of partitions that hold no row) every S seconds beside them, "
        "also with --hold-horizon; the references keep autovacuum at its defaults (default 0: none)",
    )
    ap.add_argument(
        "--engine-recycle-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="each engine process's own partition recycling, DbQueue(recycle_interval=S) (default 1, "
        "the engine's default; 0: off)",
    )


def design_options(ap: argparse.ArgumentParser) -> None:
    """The options of which designs a run measures, and the rows ring's capacity."""
    ap.add_argument("--design", choices=ALL_DESIGNS, default="table")
    ap.add_argument(
        "--also",
        nargs="+",
        choices=ENGINE_DESIGNS,
        default=[],
        metavar="DESIGN",
        help=f"more engine designs ({', '.join(ENGINE_DESIGNS)}) measured at every point in the same run, "
        "in turn with --design and the naive queue, each reported beside them",
    )
    ap.add_argument(
        "--feature",
        nargs="+",
        default=[],
        metavar="FEATURE",
        help="with --design table: the table design's push options, each a queue of its own measured at "
        "every point in the same run, in turn with the default queue and the naive queue: ordering[:KEYS] "
        "(ordering per key, every push naming one of KEYS keys in turn, default 1000), dedup (a "
        "deduplication key on every message, none repeated), ttl (a queue ttl every message carries)",
    )
    ap.add_argument(
        "--rows-capacity",
        type=int,
        help="pushes a ring-rows queue holds, a multiple of 4 (default: twice the pushes of the backlog "
        "cap and those in flight, at least 64)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Full push-then-pop cycles/s of a queue design against the naive baseline.",
        epilog="Without --producers/--consumers/--batch: sweeps P x C in 1x1..8x8, batch in 1, 100, 1000.",
    )
    design_options(ap)
    ap.add_argument("--producers", type=int, help="producer processes (default: swept)")
    ap.add_argument("--consumers", type=int, help="consumer processes (default: swept)")
    ap.add_argument("--batch", type=int, help="messages per push and per pop (default: swept)")
    ap.add_argument(
        "--seconds", type=float, help="measured window per run (default 10; --hold-horizon's S with it)"
    )
    ap.add_argument("--sweep-seconds", type=float, help="window per run in a sweep (default: --seconds)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up before the window")
    ap.add_argument("--semantics", choices=SEMANTICS, default="at-most-once")
    ap.add_argument("--payload-bytes", type=int, default=300)
    ap.add_argument(
        "--pop",
        choices=("payloads", "messages"),
        default="payloads",
        help="at most once, the engine's consumers pop with pop_payloads (default), which returns what "
        "they use as the naive queue's pop does, or with pop, which builds a Message a message",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per design and point, alternating with the baseline; reports the median (default 1)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object per point")
    ap.add_argument(
        "--pooler",
        choices=("none", "session", "transaction"),
        default="none",
        help="put a PgBouncer (Debian's pgbouncer) in this pool mode between every design's workers and "
        "the server; behind transaction mode the engine runs with pooler='transaction' and the "
        "references prepare nothing either (default none: straight to the server)",
    )
    ap.add_argument("--dsn", help=f"database (default ${TEST_DSN_ENV}, else a throwaway embedded server)")
    ap.add_argument(
        "--archive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engine queue keeps finished messages for the archiver (engine default: on)",
    )
    ap.add_argument("--notify", choices=("never", "auto", "always"), default="never")
    ap.add_argument(
        "--pgmq",
        action="store_true",
        help="also measure PGMQ's statements (read with a visibility time, then delete; archive with "
        "--archive) in the same run, as a second reference",
    )
    ap.add_argument("--capacity", type=int, help="ring slots (default: backlog cap + batches in flight)")
    ap.add_argument(
        "--groups",
        type=int,
        default=1,
        help="consumer groups of the ring, each with --consumers consumers; a cycle is a message pushed "
        "and popped in every group (default 1)",
    )
    ap.add_argument("--backlog-cap", type=int, help="pause producers above this backlog (50 x batch x C)")
    ap.add_argument("--drain-timeout", type=float, default=120.0)
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_load_options(ap)
    ap.add_argument(
        "--maintenance",
        action="store_true",
        help="latency percentiles without and with maintenance running (one point; default 2x2, batch 100)",
    )
    ap.add_argument(
        "--with-maintenance",
        action="store_true",
        help="the engine design's runs of each point have the maintenance process looping beside them "
        "(as --maintenance's runs with it on); the references keep autovacuum at its defaults",
    )
    ap.add_argument(
        "--reference-vacuum",
        action="store_true",
        help="with --with-maintenance, the references' runs have a loop of VACUUM (ANALYZE) of their "
        "tables beside them, at the same interval",
    )
    intervals(ap)
    ap.add_argument(
        "--maintenance-reindex",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the maintenance process rebuilds bloated indexes (default) or only archives and VACUUMs",
    )
    ap.add_argument(
        "--archive-after",
        type=float,
        default=0.0,
        help="maintenance archives messages finished this long ago",
    )
    args = ap.parse_args(argv)
    args.pooler_dsn = None  # set once the pooler runs (main)
    check_window(ap, args)
    for name in ("producers", "consumers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name} must be >= 1")
    if args.batch is not None and not 1 <= args.batch <= 100_000:
        ap.error("--batch must be in 1..100000")
    if args.seconds <= 0 or (args.sweep_seconds is not None and args.sweep_seconds <= 0) or args.warmup < 0:
        ap.error("--seconds and --sweep-seconds must be > 0, --warmup >= 0")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.with_maintenance and (args.maintenance or args.design not in ENGINE_DESIGNS):
        ap.error("--with-maintenance runs beside an engine design's points, not with --maintenance")
    if args.reference_vacuum and not args.with_maintenance:
        ap.error("--reference-vacuum goes with --with-maintenance")
    check_designs(ap, args)
    if args.payload_bytes < HEADER.size:
        ap.error(f"--payload-bytes must be >= {HEADER.size} (the (producer, seq) header)")
    return args


def check_designs(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the measured designs (--design and --also) cannot run: groups other than on the
    slots ring, --also beside a maintenance or recycling loop."""
    measured = {args.design, *args.also}
    if args.groups < 1 or (args.groups > 1 and measured != {"ring"}):
        ap.error("--groups must be >= 1, and above 1 only with --design ring (and no other --also)")
    if args.also and (args.maintenance or args.with_maintenance or args.recycle_interval):
        ap.error("--also goes without --maintenance, --with-maintenance and --recycle-interval")
    for f in args.feature:
        try:
            split_feature(f"table+{f}")
        except ValueError as exc:
            ap.error(f"--feature {exc}")
    if args.feature and (
        args.design != "table" or args.maintenance or args.with_maintenance or args.recycle_interval
    ):
        ap.error(
            "--feature goes with --design table, without --maintenance, --with-maintenance and "
            "--recycle-interval"
        )
    if len(set(args.feature)) != len(args.feature):
        ap.error("--feature names each feature once")


def check_window(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set the measured window: --seconds (default 10), or with --hold-horizon its S seconds; refuse
    what --hold-horizon does not go with, and a --rate that is not positive."""
    if args.rate is not None and args.rate <= 0:
        ap.error("--rate must be > 0 (messages a second)")
    if args.recycle_interval < 0 or (
        args.recycle_interval and (args.design != "table" or args.maintenance or args.with_maintenance)
    ):
        ap.error(
            "--recycle-interval S (S > 0) goes with --design table, without --maintenance and "
            "--with-maintenance"
        )
    if args.also_unheld and not args.hold_horizon:
        ap.error("--also-unheld goes with --hold-horizon S")
    if not args.hold_horizon:
        if args.seconds is None:
            args.seconds = 10.0
        return
    if args.hold_horizon < 2:
        ap.error("--hold-horizon must be 0 (no hold) or at least 2 seconds")
    # the held window is the measured window: --seconds and --sweep-seconds may only repeat it
    for name in ("seconds", "sweep_seconds"):
        given = getattr(args, name)
        if given is not None and given != args.hold_horizon:
            ap.error(f"--hold-horizon S sets the window to S seconds: --{name.replace('_', '-')} must be S")
    if args.maintenance or args.with_maintenance:
        ap.error("--hold-horizon goes without --maintenance and --with-maintenance")
    args.seconds = args.hold_horizon


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_design(args.design)
    except DesignNotAvailable as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 2
    if args.maintenance:
        if args.design not in ENGINE_DESIGNS:
            print(
                f"run.py: --maintenance measures an engine design ({', '.join(ENGINE_DESIGNS)})",
                file=sys.stderr,
            )
            return 2
        return main_maintenance(args)
    points = plan(args.producers, args.consumers, args.batch)
    sweep = None in (args.producers, args.consumers, args.batch)
    seconds = args.sweep_seconds if sweep and args.sweep_seconds else args.seconds
    cores = os.cpu_count() or 0
    all_valid = True
    try:
        with database(args.dsn) as (dsn, where), pooler(args, dsn) as through:
            info = server_info(dsn)
            if not args.json:
                print(
                    f"PostgreSQL {info['server_version']} ({where}; shared_buffers={info['shared_buffers']}, "
                    f"synchronous_commit={info['synchronous_commit']}, fsync={info['fsync']}) | "
                    f"machine: {cores} cores, load average {os.getloadavg()[0]:.1f}"
                )
                print(
                    f"design {args.design} vs naive | {args.semantics} | payload {args.payload_bytes} B | "
                    f"{seconds:g} s per run after {args.warmup:g} s warm-up{through}"
                    + (f", median of {args.repeat}" if args.repeat > 1 else "")
                    + (
                        f" | archive={'on' if args.archive else 'off'} notify={args.notify}"
                        if args.design == "table"
                        else f" | notify={args.notify}"
                        if args.design in ("ring", RING_ROWS)
                        else ""
                    )
                    + (
                        f" | {args.design} with maintenance every {args.maintenance_interval:g}s "
                        f"(archive after {args.archive_after:g}s, VACUUM"
                        + (", reindex)" if args.maintenance_reindex else ")")
                        + (", references with VACUUM as often" if args.reference_vacuum else "")
                        if args.with_maintenance
                        else ""
                    )
                    + (
                        f" | xmin horizon held over each window of {args.hold_horizon:g} s"
                        if args.hold_horizon
                        else ""
                    )
                    + (f" | producers paced at {args.rate:,.0f} messages/s" if args.rate else "")
                    + (f" | also {', '.join(args.also)}" if args.also else "")
                )
                print(table_header(), flush=True)
            for point in points:
                row = measure_point(args, dsn, point, seconds)
                row["pg_version"] = info["server_version"]
                row["cores"] = cores
                row["load_avg_1m"] = round(os.getloadavg()[0], 2)
                row["pooler"] = args.pooler
                all_valid &= row["valid"]
                print(json.dumps(row) if args.json else table_row(row), flush=True)
                if (row.get("also") or row.get("features")) and not args.json:
                    print(also_lines(row), flush=True)
                if args.hold_horizon and not args.json:
                    print(hold_table(row), flush=True)
                if row.get("unheld") and not args.json:
                    print(unheld_lines(row), flush=True)
    except (BenchError, DbQueueError, psycopg.Error) as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 1
    if not all_valid:
        print("run.py: INVALID run: messages were lost, duplicated or corrupted", file=sys.stderr)
        return 1
    return 0


def main_maintenance(args: argparse.Namespace) -> int:
    """``--maintenance``: one point, without and with maintenance running, latency percentiles."""
    p = args.producers or args.consumers or 2
    point = Point(p, args.consumers or p, args.batch or 100)
    cores = os.cpu_count() or 0
    try:
        with database(args.dsn) as (dsn, where), pooler(args, dsn):
            info = server_info(dsn)
            row = measure_maintenance_point(args, dsn, point, args.seconds)
            row["pooler"] = args.pooler
            row["pg_version"] = info["server_version"]
            row["cores"] = cores
            row["load_avg_1m"] = round(os.getloadavg()[0], 2)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"PostgreSQL {info['server_version']} ({where}; synchronous_commit="
                    f"{info['synchronous_commit']}, fsync={info['fsync']}) | machine: {cores} cores, "
                    f"load average {row['load_avg_1m']:.1f}"
                )
                print(
                    f"design {args.design} | {args.semantics} | {point.producers}x{point.consumers} batch "
                    f"{point.batch} | payload {args.payload_bytes} B | {args.seconds:g} s per run, "
                    f"maintenance off then on, {args.repeat} run(s) each | maintenance every "
                    f"{args.maintenance_interval:g}s: archive after {args.archive_after:g}s, VACUUM, reindex"
                )
                print(maintenance_table(row), flush=True)
    except (BenchError, DbQueueError, psycopg.Error) as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 1
    if not row["valid"]:
        print("run.py: INVALID run: messages were lost, duplicated or corrupted", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
