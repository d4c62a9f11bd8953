"""Scale: what a push, a pop, a queue's stats and a maintenance run cost as the history grows, against
the naive queue in the same run where it has one.

Two kinds of points, each printed as one JSON object a line (``--json``) or a line of text:

- ``depth``: a queue filled to ``--depth`` messages, VACUUMed, then ``depth / 2`` of them popped (so the
  ready index holds that many entries of popped messages since the last VACUUM: autovacuum is off for
  the point's tables on both sides unless ``--autovacuum``), then pushes and pops
  of ``--batch`` timed, alternating engine and naive queue, ``--repeat`` rounds of ``--calls`` calls
  each. The engine's queue has the engine defaults (table design, ``archive=True``, ``notify="auto"``).
  Also one ``stats()`` timed. Payloads vary per message (benchmarks/payloads.py); every pop checks each
  payload's bytes against its header, and at the end each queue is drained and counted: pushed, popped
  and the sum of the messages' numbers must match (``checksum_ok``).
- ``queues``: ``--queues`` table-design queues (engine defaults) in one schema, each pushed
  ``--per-queue`` messages and popped half of them (so ``done`` holds the other half's finished rows,
  as a queue that archives keeps them until the archiver moves them); then ``stats()`` of every queue
  timed (``--repeat`` times), and one maintenance run (:meth:`DbQueue.maintain`, what ``dbqueue
  maintain`` runs) timed. The stats' figures are checked against what was pushed and popped.

- ``rings``: a ring of ``--ring-capacity`` made in each layout (``slots``: the capacity in slots, laid
  out at creation; ``rows``: the capacity in pushes, written as pushes come), timed, with the bytes its
  creation added to the schema's tables and indexes; then ``--batch`` messages pushed and popped
  through it (counted and checked) before it is dropped.

``--quick`` runs small versions of all three (depth 20,000, 100 queues, rings of 10,000) in well under
a minute: the test suite runs it (tests/integration/test_scale_smoke.py).

Examples::

    .venv/bin/python benchmarks/scale.py --points depth --depth 1000000 --json
    .venv/bin/python benchmarks/scale.py --points queues --queues 1000 --json
    .venv/bin/python benchmarks/scale.py --points rings --ring-capacity 6000000 --json
    .venv/bin/python benchmarks/scale.py --quick --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.backends import naive_statements
from payloads import fillers, make

from airflow_dbqueue.engine import DbQueue

HEADER = struct.Struct(">II")
"""A payload's header: the sender (0 the engine's queue, 1 the naive one) and the message's number."""


def _dsn(arg: str | None) -> Iterator[str]:
    """The DSN given, ``$DBQUEUE_TEST_DSN``, or a throwaway embedded server (stopped afterwards)."""
    dsn = arg or os.environ.get("DBQUEUE_TEST_DSN")
    if dsn:
        yield dsn
        return
    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

    with tempfile.TemporaryDirectory(prefix="dbqueue-scale-") as tmp:
        server = EmbeddedPostgres(Path(tmp) / "data")
        try:
            yield server.start()
        finally:
            server.stop()


class Counter:
    """What went in and came out of one queue: counts, and the sum of the message numbers."""

    def __init__(self, sender: int, payload_bytes: int) -> None:
        self.sender = sender
        self.fill = fillers(payload_bytes, HEADER.size)
        self.next = 0
        self.pushed = self.popped = 0
        self.pushed_sum = self.popped_sum = 0
        self.bad = 0

    def batch(self, n: int) -> list[bytes]:
        out = [make(HEADER, self.fill, self.sender, self.next + i) for i in range(n)]
        self.pushed += n
        self.pushed_sum += sum(range(self.next, self.next + n))
        self.next += n
        return out

    def took(self, payloads: list[bytes]) -> int:
        for p in payloads:
            a, b = HEADER.unpack_from(p)
            if a != self.sender or p[HEADER.size :] != self.fill.pick(a, b):
                self.bad += 1
            self.popped += 1
            self.popped_sum += b
        return len(payloads)

    def result(self) -> dict[str, Any]:
        return {
            "pushed": self.pushed,
            "popped": self.popped,
            "bad_payloads": self.bad,
            "checksum_ok": self.bad == 0
            and self.pushed == self.popped
            and self.pushed_sum == self.popped_sum,
        }


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _timed(fn: Callable[[], object], calls: int) -> float:
    """Seconds ``calls`` calls of ``fn`` took."""
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t


def _spread(rates: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(rates), 1),
        "min": round(min(rates), 1),
        "max": round(max(rates), 1),
    }


# -- depth -------------------------------------------------------------------------------------------


def depth_point(  # noqa: PLR0915
    dsn: str, depth: int, *, batch: int, calls: int, repeat: int, payload_bytes: int, autovacuum: bool
) -> dict[str, Any]:
    """The ``depth`` point (see the module's docstring)."""
    schema = f"scale_{uuid.uuid4().hex[:8]}"
    naive_schema = schema + "_naive"
    engine = Counter(0, payload_bytes)
    naive = Counter(1, payload_bytes)
    fill_batch = 1000
    with contextlib.ExitStack() as stack:
        dbq = stack.enter_context(DbQueue(dsn, schema=schema))
        dbq.install()
        stack.callback(dbq.uninstall)
        q = dbq.create_queue("scale", payload_type="bytes")  # engine defaults otherwise
        conn = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        s = sql.Identifier(naive_schema)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        stack.callback(conn.execute, sql.SQL("DROP SCHEMA {} CASCADE").format(s))
        conn.execute(
            sql.SQL("CREATE TABLE {}.t (id bigserial PRIMARY KEY, payload bytea NOT NULL)").format(s)
        )
        push_sql, pop_sql = naive_statements(naive_schema)
        if not autovacuum:  # the popped messages' dead rows and index entries stay until the end
            conn.execute(sql.SQL("ALTER TABLE {}.t SET (autovacuum_enabled = false)").format(s))
            for table in ("meta", "data", "done"):
                for g in range(8):
                    conn.execute(
                        sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(
                            sql.Identifier(schema, f"{table}_{g}")
                        )
                    )

        def naive_push(n: int) -> None:
            conn.execute(push_sql, (naive.batch(n),))

        def naive_pop(n: int) -> int:
            return naive.took([r[0] for r in conn.execute(pop_sql, (n,), binary=True).fetchall()])

        def engine_push(n: int) -> None:
            q.push_batch(engine.batch(n))

        def engine_pop(n: int) -> int:
            return engine.took(q.pop_payloads(n))

        started = time.monotonic()
        for _ in range(0, depth + depth // 2, fill_batch):
            engine_push(fill_batch)
            naive_push(fill_batch)
        filled_s = time.monotonic() - started
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}.t").format(s))
        for table in ("meta", "data", "done"):
            conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(schema, table)))
        popped_before = 0
        while popped_before < depth // 2:
            n = min(fill_batch, depth // 2 - popped_before)
            assert engine_pop(n) == n and naive_pop(n) == n
            popped_before += n
        rates: dict[str, list[float]] = {"table_push": [], "naive_push": [], "table_pop": [], "naive_pop": []}
        for _ in range(repeat):
            rates["table_push"].append(batch * calls / _timed(lambda: engine_push(batch), calls))
            rates["naive_push"].append(batch * calls / _timed(lambda: naive_push(batch), calls))
            rates["table_pop"].append(batch * calls / _timed(lambda: engine_pop(batch), calls))
            rates["naive_pop"].append(batch * calls / _timed(lambda: naive_pop(batch), calls))
        reads = _reads_per_push(dbq, q, engine, schema, batch)
        t = time.perf_counter()
        st = q.stats()
        stats_s = time.perf_counter() - t
        left = st.ready + st.delayed + st.in_flight + st.failed
        expected_left = engine.pushed - engine.popped
        while engine_pop(fill_batch):
            pass
        while naive_pop(fill_batch):
            pass
    push_ratio = statistics.median(rates["table_push"]) / statistics.median(rates["naive_push"])
    pop_ratio = statistics.median(rates["table_pop"]) / statistics.median(rates["naive_pop"])
    return {
        "point": "depth",
        "depth": depth,
        "popped_since_vacuum": depth // 2,
        "autovacuum": autovacuum,
        "batch": batch,
        "calls": calls,
        "repeat": repeat,
        "payload_bytes": payload_bytes,
        "fill_s": round(filled_s, 1),
        "msgs_per_s": {k: _spread(v) for k, v in rates.items()},
        "push_ratio": round(push_ratio, 3),
        "pop_ratio": round(pop_ratio, 3),
        "push_index_reads": reads,
        "stats_ms": round(stats_s * 1000, 1),
        "stats": st.as_dict(),
        "stats_left_expected": expected_left,
        "stats_left": left,
        "engine": engine.result(),
        "naive": naive.result(),
        "load_1m": _load(),
    }


def _reads_per_push(dbq: DbQueue, q: Any, counter: Counter, schema: str, batch: int) -> dict[str, float]:
    """What a push of ``batch`` reads of meta's ready index, counted by the server, not timed: index
    entries returned, and index pages touched (its own ``batch`` insertions included), the mean of 20
    pushes on one connection (its statistics
    flushed before and after, as tests/integration/test_plans.py's scans() does)."""
    query = """
        SELECT coalesce(sum(s.idx_tup_read), 0), coalesce(sum(io.idx_blks_hit + io.idx_blks_read), 0)
        FROM pg_stat_user_indexes s JOIN pg_statio_user_indexes io USING (indexrelid)
        WHERE s.schemaname = %s AND s.indexrelname LIKE 'meta_ready_idx%%'"""
    calls = 20
    with dbq.db.connection() as c:  # type: ignore[attr-defined]

        def read() -> tuple[int, int]:
            c.execute("SELECT pg_stat_force_next_flush()")
            c.execute("SELECT 1")
            c.execute("SELECT pg_stat_clear_snapshot()")
            row = c.execute(query, (schema,)).fetchone()
            return int(row[0]), int(row[1])

        before = read()
        for _ in range(calls):
            q.push_batch(counter.batch(batch), conn=c)
        after = read()
    return {
        "entries": round((after[0] - before[0]) / calls, 1),
        "pages": round((after[1] - before[1]) / calls, 1),
    }


# -- queues ------------------------------------------------------------------------------------------


def queues_point(dsn: str, queues: int, *, per_queue: int, repeat: int, payload_bytes: int) -> dict[str, Any]:
    """The ``queues`` point (see the module's docstring)."""
    schema = f"scale_{uuid.uuid4().hex[:8]}"
    counter = Counter(0, payload_bytes)
    with DbQueue(dsn, schema=schema) as dbq:
        dbq.install()
        try:
            started = time.monotonic()
            handles = [dbq.create_queue(f"q{i}", payload_type="bytes") for i in range(queues)]
            created_s = time.monotonic() - started
            started = time.monotonic()
            for q in handles:
                q.push_batch(counter.batch(per_queue))
                counter.took(q.pop_payloads(per_queue // 2))
            filled_s = time.monotonic() - started
            stats_runs = []
            figures_ok = True
            for _ in range(repeat):
                t = time.perf_counter()
                all_stats = [q.stats() for q in handles]
                stats_runs.append(time.perf_counter() - t)
                figures_ok = figures_ok and all(
                    (s.ready, s.finished) == (per_queue - per_queue // 2, per_queue // 2) for s in all_stats
                )
            t = time.perf_counter()
            report = dbq.maintain()
            maintain_s = time.perf_counter() - t
            sampled = report.get("samples", {}).get("recorded")
            for q in handles:
                counter.took(q.pop_payloads(per_queue))
            left = sum(s.ready + s.delayed + s.in_flight + s.failed for s in (q.stats() for q in handles))
        finally:
            dbq.uninstall()
    return {
        "point": "queues",
        "queues": queues,
        "per_queue": per_queue,
        "finished_in_done": queues * (per_queue // 2),
        "create_s": round(created_s, 2),
        "fill_s": round(filled_s, 2),
        "stats_all_s": {
            "median": round(statistics.median(stats_runs), 3),
            "min": round(min(stats_runs), 3),
            "max": round(max(stats_runs), 3),
        },
        "stats_figures_ok": figures_ok,
        "maintain_s": round(maintain_s, 3),
        "maintain_steps_s": {
            k: report[k].get("seconds")
            for k in ("archive", "purge_archive")
            if isinstance(report.get(k), dict)
        },
        "maintain_incomplete": report.get("incomplete"),
        "samples_recorded": sampled,
        "left_in_queues": left,
        "engine": counter.result(),
        "load_1m": _load(),
    }


# -- rings -------------------------------------------------------------------------------------------


def _schema_bytes(dsn: str, schema: str) -> int:
    """Bytes of the schema's tables with their indexes and TOAST (partitions counted once each)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'",
            [schema],
        ).fetchone()
    return int(row[0]) if row else 0


def rings_point(dsn: str, capacity: int, *, batch: int, payload_bytes: int) -> dict[str, Any]:
    """The ``rings`` point (see the module's docstring)."""
    schema = f"scale_{uuid.uuid4().hex[:8]}"
    counter = Counter(0, payload_bytes)
    layouts: dict[str, dict[str, Any]] = {}
    with DbQueue(dsn, schema=schema) as dbq:
        dbq.install()
        try:
            for layout in ("slots", "rows"):
                before = _schema_bytes(dsn, schema)
                t = time.perf_counter()
                q = dbq.create_queue(
                    f"ring_{layout}",
                    design="ring",
                    layout=layout,
                    capacity=capacity,
                    payload_type="bytes",
                    max_payload_bytes=max(payload_bytes, 64),
                )
                created_s = time.perf_counter() - t
                added = _schema_bytes(dsn, schema) - before
                t = time.perf_counter()
                q.push_batch(counter.batch(batch))
                counter.took(q.pop_payloads(batch))
                first_s = time.perf_counter() - t
                dbq.drop_queue(f"ring_{layout}")
                layouts[layout] = {
                    "create_s": round(created_s, 3),
                    "bytes_added": added,
                    "first_push_pop_s": round(first_s, 4),
                }
        finally:
            dbq.uninstall()
    return {
        "point": "rings",
        "capacity": capacity,
        "batch": batch,
        "layouts": layouts,
        "engine": counter.result(),
        "load_1m": _load(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--points", default="depth,queues,rings", help="depth, queues, rings, or several (comma-separated)"
    )
    p.add_argument("--depth", type=int, action="append", help="depth of the depth point (repeatable)")
    p.add_argument("--queues", type=int, action="append", help="queues of the queues point (repeatable)")
    p.add_argument(
        "--ring-capacity",
        type=int,
        help="capacity of the rings point's rings (slots, or pushes for the rows layout; default 1,000,000)",
    )
    p.add_argument("--per-queue", type=int, default=320, help="messages pushed to each queue (half popped)")
    p.add_argument("--batch", type=int, default=100, help="messages a timed push or pop")
    p.add_argument("--calls", type=int, default=200, help="timed calls a round")
    p.add_argument("--repeat", type=int, default=3, help="rounds (depth) and stats passes (queues)")
    p.add_argument("--payload-bytes", type=int, default=300)
    p.add_argument(
        "--autovacuum",
        action="store_true",
        help="leave autovacuum on for the depth point's tables (default: off after the first VACUUM, so "
        "that every pop of the point stays a dead index entry until the end, as the issue measured)",
    )
    p.add_argument("--quick", action="store_true", help="small points for the test suite (under a minute)")
    p.add_argument("--dsn")
    p.add_argument("--json", action="store_true", help="one JSON object a point")
    args = p.parse_args(argv)
    points = {x.strip() for x in args.points.split(",") if x.strip()}
    if args.quick:
        depths, queue_counts = args.depth or [20_000], args.queues or [100]
        ring_capacity = args.ring_capacity or 10_000
        args.calls, args.repeat, args.per_queue = (
            min(args.calls, 50),
            min(args.repeat, 2),
            min(args.per_queue, 40),
        )
    else:
        depths, queue_counts = args.depth or [1_000_000], args.queues or [1000]
        ring_capacity = args.ring_capacity or 1_000_000
    ok = True
    for dsn in _dsn(args.dsn):
        out: list[dict[str, Any]] = []
        if "depth" in points:
            for d in depths:
                out.append(
                    depth_point(
                        dsn,
                        d,
                        batch=args.batch,
                        calls=args.calls,
                        repeat=args.repeat,
                        payload_bytes=args.payload_bytes,
                        autovacuum=args.autovacuum,
                    )
                )
                _emit(out[-1], args.json)
        if "queues" in points:
            for n in queue_counts:
                out.append(
                    queues_point(
                        dsn, n, per_queue=args.per_queue, repeat=args.repeat, payload_bytes=args.payload_bytes
                    )
                )
                _emit(out[-1], args.json)
        if "rings" in points:
            out.append(rings_point(dsn, ring_capacity, batch=args.batch, payload_bytes=args.payload_bytes))
            _emit(out[-1], args.json)
        with psycopg.connect(dsn) as c:
            version = c.execute("SHOW server_version").fetchone()
        print(f"# PostgreSQL {version[0] if version else '?'}", file=sys.stderr)
        ok = all(
            r["engine"]["checksum_ok"] and r.get("naive", {"checksum_ok": True})["checksum_ok"] for r in out
        )
    return 0 if ok else 1


def _emit(r: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(r), flush=True)
        return
    if r["point"] == "depth":
        m = r["msgs_per_s"]
        print(
            f"depth {r['depth']:>9,} ({r['popped_since_vacuum']:,} popped since VACUUM), batch {r['batch']}: "
            f"push {m['table_push']['median']:,.0f} vs naive {m['naive_push']['median']:,.0f} msg/s "
            f"({r['push_ratio']:.2f}x), pop {m['table_pop']['median']:,.0f} "
            f"vs {m['naive_pop']['median']:,.0f} "
            f"({r['pop_ratio']:.2f}x), stats {r['stats_ms']} ms, checksums "
            f"{r['engine']['checksum_ok'] and r['naive']['checksum_ok']}, load {r['load_1m']}",
            flush=True,
        )
    elif r["point"] == "rings":
        print(
            f"rings of capacity {r['capacity']:,}: "
            + ", ".join(
                f"{k} created in {v['create_s']} s adding {v['bytes_added'] / 2**20:,.1f} MiB, "
                f"first push and pop of {r['batch']} in {v['first_push_pop_s']} s"
                for k, v in r["layouts"].items()
            )
            + f", checksum {r['engine']['checksum_ok']}, load {r['load_1m']}",
            flush=True,
        )
    else:
        print(
            f"{r['queues']:,} queues: stats() of all {r['stats_all_s']['median']} s "
            f"({r['stats_all_s']['min']}-{r['stats_all_s']['max']}), maintain {r['maintain_s']} s, "
            f"figures {r['stats_figures_ok']}, checksum {r['engine']['checksum_ok']}, load {r['load_1m']}",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
