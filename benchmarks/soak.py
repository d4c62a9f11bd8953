#!/usr/bin/env python
"""Soak: push and pop millions of messages through one queue and watch its tables' size over time.

    python benchmarks/soak.py --design ring --messages 10000000 --capacity 10000 --batch 1000
    python benchmarks/soak.py --design table --messages 2000000 --maintain-every 5
    python benchmarks/soak.py --design ring-rows --rows-capacity 1024 --batch 100 --rate 5000 \
        --messages 1050000 --hold-after 60 --hold-for 90

Issue 3 asks that a ring's table "is the same size after 10 million messages as after the first
thousand", with HOT updates. This runs P producer and C consumer processes (at-most-once) until
``--messages`` went through, samples the queue's tables every ``--report-every`` messages, and prints
a table of heap and total bytes, their ratio to the sample taken after the first ``--baseline``
messages (the reference of the same run), the HOT-update ratio and dead tuples. For the table design
the main process runs the engine's maintenance (archive, VACUUM, online reindex) every
``--maintain-every`` seconds, as the maintenance DAG would.

With ``--hold-after A --hold-for H`` a session of its own holds the xmin horizon from A seconds into
the soak for H seconds (a REPEATABLE READ transaction with a snapshot and a transaction id), as a
lagging replication slot, a long query or an idle-in-transaction session would: no VACUUM or page
pruning can remove a row version that died meanwhile. Samples then say whether the hold was on; one
is taken as the hold starts, one just before it is released and one just after.

With ``--rate R`` the producers push R messages a second in all (paced, as a steady load below the
design's capacity), and the report adds the rates of the minute before the hold, the hold's last
minute and the minute after it (from a per-second count of pops), and the longest pop a consumer saw:

    python benchmarks/soak.py --design table --rate 5000 --messages 3000000 --batch 100 \
        --hold-after 120 --hold-for 300 --maintain-every 300

``--design ring`` is the ring of the slots layout (``--capacity`` slots), ``ring-rows`` a ring
of the rows layout (``create_queue(..., design="ring", layout="rows")``, PostgreSQL only;
``--rows-capacity`` pushes, in four segment tables emptied by ``TRUNCATE``), whose tables (its
segments and position logs) are those of its queue id.

Nothing is lost: producers report the count and a checksum of what they pushed, consumers of what
they popped, and the run fails (exit 1) unless both agree. The database is ``--dsn``, else
``$DBQUEUE_TEST_DSN``, else a throwaway embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing as mp
import queue as queue_mod
import struct
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from payloads import Fillers, make
from run import database, server_info  # benchmarks/ is a folder of scripts

from airflow_dbqueue.engine import DbQueue, MaintenanceConfig

QUEUE = "soak_q"
MASK = (1 << 64) - 1
PAYLOAD_HEADER = struct.Struct(">QQ")  # (producer, number), then a random filler (payloads.py)
# The tables on the queue's push/pop path, by design; a ring of the rows layout has tables of its own,
# named by its queue id (rows_tables).
TABLES: dict[str, tuple[str, ...]] = {
    "ring": ("ring_slots",),
    "ring-rows": (),
    "table": ("meta", "data", "done"),
}


def rows_tables(queue_id: int) -> tuple[str, ...]:
    """A ring of the rows layout's tables: its four segments and their four position logs."""
    return tuple(f"ring_{queue_id}_r{kind}{k}" for kind in ("q", "pos") for k in range(4))


def digest(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big")


def add_digests(total: int, payloads: Iterable[bytes]) -> int:
    """``total`` plus the digests of ``payloads``: the checksum producers and consumers keep."""
    return (total + sum(digest(p) for p in payloads)) & MASK


def tally(pushed: list[tuple[int, int]], popped: list[tuple[int, int]], left: int) -> dict[str, Any]:
    """Compare the producers' ``(count, checksum)`` reports with the consumers', ``left`` messages still
    in the queue: ``checksum_ok`` only when counts and checksums agree. ``lost`` and ``duplicated`` come
    from the counts alone, so a lost message and a duplicated one cancel there; the checksum tells."""
    n_in, n_out = sum(n for n, _ in pushed), sum(n for n, _ in popped)
    sum_in = sum(c for _, c in pushed) & MASK
    sum_out = sum(c for _, c in popped) & MASK
    return {
        "pushed": n_in,
        "popped": n_out,
        "checksum_ok": sum_in == sum_out and n_in == n_out,
        "lost": max(0, n_in - n_out - left),
        "duplicated": max(0, n_out - n_in),
    }


def valid(result: dict[str, Any], messages: int) -> bool:
    """Whether a soak of ``messages`` went right: every message pushed, popped once (counts and
    checksums agree), nothing left in the queue, and no process reported an error."""
    return bool(
        result["checksum_ok"]
        and not result["errors"]
        and result["pushed"] == messages
        and result["left_in_queue"] == 0
    )


@dataclasses.dataclass(frozen=True)
class Job:
    dsn: str
    schema: str
    batch: int
    payload_bytes: int
    messages: int
    rate: float | None = None
    """Messages a second each producer pushes (None: as fast as it can)."""


def producer(job: Job, index: int, share: int, out: Any, errors: Any) -> None:
    """Push ``share`` messages in batches; report (count, checksum) of what was pushed."""
    count = total = 0
    batch, fillers = job.batch, Fillers(job.payload_bytes, PAYLOAD_HEADER.size)
    try:
        with DbQueue(job.dsn, schema=job.schema, pool_size=1) as dbq:
            q = dbq.queue(QUEUE)
            began = time.monotonic()
            while count < share:
                if job.rate:  # paced: the batch's messages are due at count / rate seconds from the start
                    ahead = began + count / job.rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                n = min(batch, share - count)
                payloads = [make(PAYLOAD_HEADER, fillers, index, count + i) for i in range(n)]
                q.push_batch(payloads)
                count += n
                total = add_digests(total, payloads)
    except Exception as exc:
        errors.put(f"producer {index}: {type(exc).__name__}: {exc}")
    out.put(("pushed", count, total))


def consumer(job: Job, popped: Any, done_pushing: Any, out: Any, errors: Any) -> None:
    """Pop until every message went through; report (count, checksum) of what was popped, and the
    longest pop that does not wait for a push (a waiting pop's wait is not counted; a pop that does not
    wait and still takes long waited for a lock or the machine). A paced run's consumers keep up, so
    most of their messages come through the waiting pop: the one before it, empty or not, is timed."""
    count = total = empty = 0
    longest = 0.0
    try:  # a waiting pop LISTENs on a connection of its own
        with DbQueue(job.dsn, schema=job.schema, pool_size=2) as dbq:
            q = dbq.queue(QUEUE)
            while True:
                t0 = time.monotonic()
                msgs = q.pop(job.batch)
                longest = max(longest, time.monotonic() - t0)
                if not msgs:
                    msgs = q.pop(job.batch, wait=0.5)
                if msgs:
                    empty = 0
                    count += len(msgs)
                    total = add_digests(total, (m.payload for m in msgs))
                    with popped.get_lock():
                        popped.value += len(msgs)
                elif done_pushing.is_set():
                    empty += 1  # all pushed: stop once all came through, or the queue stays empty 3 s
                    if popped.value >= job.messages or empty >= 6:
                        break
    except Exception as exc:
        errors.put(f"consumer: {type(exc).__name__}: {exc}")
    out.put(("popped", count, total, longest))


def sample(dsn: str, schema: str, tables: tuple[str, ...]) -> dict[str, Any]:
    """Heap and total (indexes, TOAST) bytes of ``tables`` (with their partitions: the table design's are
    partitioned, and a partitioned table holds no rows itself), their HOT-update ratio and dead tuples."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT sum(pg_relation_size(c.oid)), sum(pg_total_relation_size(c.oid)), "
            "sum(s.n_tup_upd), sum(s.n_tup_hot_upd), sum(s.n_dead_tup) "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_stat_user_tables s ON s.relid = c.oid "
            "WHERE n.nspname = %s AND (c.relname = ANY (%s) OR c.oid IN ("
            "  SELECT i.inhrelid FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent"
            "  WHERE p.relnamespace = n.oid AND p.relname = ANY (%s)))",
            (schema, list(tables), list(tables)),
        ).fetchone()
        # pg_partition_tree lists a partitioned table with its partitions, and nothing for a plain table:
        # the table itself is added (UNION: once)
        by_table = conn.execute(
            "SELECT t, coalesce(sum(pg_total_relation_size(p.relid)), 0) "
            "FROM unnest(%s::text[]) AS t, "
            "LATERAL (SELECT format('%%I.%%I', %s::text, t)::regclass AS r) AS x, "
            "LATERAL (SELECT relid FROM pg_partition_tree(x.r) UNION SELECT x.r) AS p GROUP BY t",
            (list(tables), schema),
        ).fetchall()
    heap, total, upd, hot, dead = (int(x or 0) for x in row) if row else (0, 0, 0, 0, 0)
    return {
        "heap_bytes": heap,
        "total_bytes": total,
        "hot_ratio": hot / upd if upd else None,
        "dead": dead,
        "table_bytes": {str(t): int(b) for t, b in by_table},
    }


class Hold(threading.Thread):
    """A held xmin horizon: from ``after`` seconds past ``start`` for ``hold_for`` seconds, a session
    of its own in a REPEATABLE READ transaction that took a transaction id and a snapshot (a read of
    ``pg_class``, so that it locks none of the queue's tables). A thread of its own ends it on time
    even while the soak's main loop waits in a maintenance step (an online index rebuild waits for
    every older snapshot, this one too). Just before the release it samples the queue's tables."""

    def __init__(
        self, dsn: str, schema: str, tables: tuple[str, ...], *, start: float, after: float, hold_for: float
    ) -> None:
        super().__init__(name="soak-hold", daemon=True)
        self.dsn, self.schema, self.tables = dsn, schema, tables
        self.start_at, self.after, self.hold_for = start, after, hold_for
        self.stop = threading.Event()
        self.on = False
        self.started_s: float | None = None
        self.ended_s: float | None = None
        self.last_sample: dict[str, Any] | None = None
        """The sample taken just before the release."""
        self.xmin_age: int | None = None
        """Transaction ids assigned after the hold's snapshot, when it was released."""
        self.error: str | None = None

    def elapsed(self) -> float:
        return round(time.monotonic() - self.start_at, 1)

    def run(self) -> None:
        if self.stop.wait(max(0.0, self.start_at + self.after - time.monotonic())):
            return
        try:
            with psycopg.connect(self.dsn, application_name="dbqueue-soak-hold") as conn:
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                row = conn.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                conn.execute("SELECT txid_current()").fetchone()
                conn.execute("SELECT count(*) FROM pg_catalog.pg_class").fetchone()
                self.on, self.started_s = True, self.elapsed()
                self.stop.wait(self.hold_for)
                with psycopg.connect(self.dsn, autocommit=True) as other:
                    age = other.execute(
                        "SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = %s", (row[0],)
                    ).fetchone()
                self.xmin_age = None if age is None or age[0] is None else int(age[0])
                self.last_sample = {
                    "messages": None,
                    "seconds": self.elapsed(),
                    **sample(self.dsn, self.schema, self.tables),
                    "hold": True,
                }
                conn.rollback()
        except Exception as exc:
            self.error = f"hold: {type(exc).__name__}: {exc}"
        finally:
            self.on, self.ended_s = False, self.elapsed()

    def release(self) -> None:
        """End the hold now (if it is on) and wait for the thread."""
        self.stop.set()
        self.join(30)


def run(args: argparse.Namespace, dsn: str) -> dict[str, Any]:  # noqa: PLR0912, PLR0915
    """Push and pop the soak's messages through one queue, reporting the tables' size as it goes. Long on
    purpose: one soak in order (set up, move and report, drain, check), sharing its counters throughout."""
    schema = f"soak_{uuid.uuid4().hex[:10]}"
    tables = TABLES[args.design]
    with DbQueue(dsn, schema=schema, pool_size=1) as dbq:
        dbq.install()
        if args.design == "ring":
            dbq.create_queue(
                QUEUE,
                design="ring",
                layout="slots",
                capacity=args.capacity,
                payload_type="bytes",
                max_payload_bytes=args.payload_bytes,
                notify="auto",
            )
        elif args.design == "ring-rows":
            created = dbq.create_queue(
                QUEUE,
                design="ring",
                layout="rows",
                capacity=args.rows_capacity,
                payload_type="bytes",
                notify="auto",
            )
            tables = rows_tables(created.settings.queue_id)
        else:
            dbq.create_queue(QUEUE, payload_type="bytes", notify="auto")
        ctx = mp.get_context("spawn")
        popped, done_pushing = ctx.Value("q", 0), ctx.Event()
        out, errors = ctx.Queue(), ctx.Queue()
        job = Job(
            dsn,
            schema,
            args.batch,
            args.payload_bytes,
            args.messages,
            args.rate / args.producers if args.rate else None,
        )
        share, extra = divmod(args.messages, args.producers)
        producers = [
            ctx.Process(target=producer, args=(job, i, share + (i < extra), out, errors))
            for i in range(args.producers)
        ]
        consumers = [
            ctx.Process(target=consumer, args=(job, popped, done_pushing, out, errors))
            for _ in range(args.consumers)
        ]
        config = MaintenanceConfig(archive_after_s=0, archive_retention_s=0, pause_s=0)
        samples: list[dict[str, Any]] = []
        baseline: dict[str, Any] | None = None
        next_report = args.report_every
        start = last_maintenance = time.monotonic()
        holding = args.hold_for is not None
        hold = (
            Hold(dsn, schema, tables, start=start, after=args.hold_after, hold_for=args.hold_for)
            if holding
            else None
        )
        hold_seen = False  # the hold's state at the last look: a change takes a sample
        # (seconds, messages popped) once a second, from a thread of its own: the main loop stops for
        # as long as a maintenance run takes (minutes, after a hold).
        timeline: list[tuple[float, int]] = []
        ticking = threading.Event()

        def tick() -> None:
            while not ticking.wait(max(0.0, start + len(timeline) - time.monotonic())):
                timeline.append((round(time.monotonic() - start, 2), popped.value))

        ticker = threading.Thread(target=tick, name="soak-timeline", daemon=True)

        def show(s: dict[str, Any]) -> None:
            samples.append(s)
            print(report_row(s, baseline, holding), file=sys.stderr, flush=True)

        def take(n: int) -> None:
            s = {"messages": n, "seconds": round(time.monotonic() - start, 1), **sample(dsn, schema, tables)}
            if hold is not None:
                s["hold"] = hold.on
            show(s)

        for p in [*producers, *consumers]:
            p.start()
        ticker.start()
        if hold is not None:
            hold.start()
        try:
            while True:
                time.sleep(0.2)
                # Whether the consumers are done is read before the count: read after it, the last
                # pops could land between the two reads and the run end on a count short of them.
                finished = not any(c.is_alive() for c in consumers)
                n = popped.value
                if not done_pushing.is_set() and not any(p.is_alive() for p in producers):
                    done_pushing.set()
                if baseline is None and n >= args.baseline:
                    baseline = {"messages": n, **sample(dsn, schema, tables)}
                if args.design == "table" and time.monotonic() - last_maintenance >= args.maintain_every:
                    dbq.maintain(config)
                    last_maintenance = time.monotonic()
                if hold is not None:
                    if finished:  # a hold still on ends with the soak, before its last sample
                        hold.release()
                    if hold.on != hold_seen:
                        hold_seen = not hold_seen
                        if not hold_seen and hold.last_sample is not None:  # taken before the release
                            show({**hold.last_sample, "messages": n})
                        if not finished:
                            take(n)
                if n >= next_report or finished:
                    take(n)
                    while next_report <= n:
                        next_report += args.report_every
                if finished:
                    break
        finally:
            ticking.set()
            ticker.join(5)
            if hold is not None:
                hold.release()
            for p in [*producers, *consumers]:
                p.join(5)
                if p.is_alive():
                    p.kill()
        results, problems = [], []
        for _ in range(args.producers + args.consumers):
            try:
                results.append(out.get(timeout=5))
            except queue_mod.Empty:
                problems.append("a producer or consumer process died without reporting")
                break
        while not errors.empty():
            problems.append(errors.get())
        if hold is not None and hold.error:
            problems.append(hold.error)
        pushed = [(r[1], r[2]) for r in results if r[0] == "pushed"]
        got = [(r[1], r[2]) for r in results if r[0] == "popped"]
        longest_pop = max((r[3] for r in results if r[0] == "popped"), default=None)
        stats = dbq.queue(QUEUE).stats()
        left = stats.ready + stats.delayed + stats.in_flight + stats.failed
        dbq.uninstall()
    elapsed = samples[-1]["seconds"] if samples else 0.0
    counted = tally(pushed, got, left)
    held: dict[str, Any] = {}
    if hold is not None:
        held = {
            "hold_after_s": args.hold_after,
            "hold_for_s": args.hold_for,
            "hold_started_s": hold.started_s,
            "hold_ended_s": hold.ended_s,
            "hold_xmin_age": hold.xmin_age,
        }
        if hold.started_s is not None and hold.ended_s is not None:
            on, off = hold.started_s, hold.ended_s
            minute = min(60.0, off - on)
            held["rate_before_hold"] = window_rate(timeline, on - minute, on)
            held["rate_hold_last_minute"] = window_rate(timeline, off - minute, off)
            held["rate_after_hold"] = window_rate(timeline, off, off + minute)
            before, last = held["rate_before_hold"], held["rate_hold_last_minute"]
            held["hold_kept"] = round(last / before, 3) if before and last is not None else None
    return {
        "design": args.design,
        "capacity": capacity_of(args),
        "producers": args.producers,
        "consumers": args.consumers,
        "batch": args.batch,
        "payload_bytes": args.payload_bytes,
        "messages": args.messages,
        **counted,
        "left_in_queue": left,
        "errors": problems,
        "seconds": elapsed,
        "cycles_per_s": round(counted["popped"] / elapsed, 1) if elapsed else None,
        "baseline": baseline,
        "samples": samples,
        "rate": args.rate,
        "longest_pop_s": None if longest_pop is None else round(longest_pop, 4),
        "timeline": timeline,
        "final_size_ratio": (
            round(samples[-1]["total_bytes"] / baseline["total_bytes"], 3)
            if samples and baseline and baseline["total_bytes"]
            else None
        ),
        **held,
    }


def capacity_of(args: argparse.Namespace) -> int | None:
    """The ring's capacity: slots (ring), pushes (ring-rows); None for the table design."""
    return {"ring": args.capacity, "ring-rows": args.rows_capacity}.get(args.design)


def window_rate(timeline: list[tuple[float, int]], since: float, until: float) -> float | None:
    """Messages popped a second between ``since`` and ``until`` seconds into the soak, from the
    timeline's points nearest inside the window (None: fewer than two points in it)."""
    inside = [(t, n) for t, n in timeline if since <= t <= until]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]), 1)


def report_row(s: dict[str, Any], baseline: dict[str, Any] | None, holding: bool = False) -> str:
    ratio = (
        f"{s['total_bytes'] / baseline['total_bytes']:.2f}" if baseline and baseline["total_bytes"] else "-"
    )
    hot = "-" if s["hot_ratio"] is None else f"{s['hot_ratio']:.1%}"
    rate = f"{s['messages'] / s['seconds']:,.0f}" if s["seconds"] else "-"
    return (
        f"{s['messages']:>12,}  {s['seconds']:>8.1f}  {rate:>9}  {s['heap_bytes'] / 1e6:>9.2f}  "
        f"{s['total_bytes'] / 1e6:>9.2f}  {ratio:>6}  {hot:>6}  {s['dead']:>9,}"
        + (f"  {'on' if s.get('hold') else '-':>4}" if holding else "")
    )


HEADER = (
    f"{'messages':>12}  {'seconds':>8}  {'msg/s':>9}  {'heap MB':>9}  {'total MB':>9}  {'ratio':>6}  "
    f"{'HOT':>6}  {'dead tup':>9}"
)
HOLD_COLUMN = f"  {'hold':>4}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Soak a queue with millions of messages; watch its size.")
    ap.add_argument("--design", choices=sorted(TABLES), default="ring")
    ap.add_argument("--messages", type=int, default=10_000_000)
    ap.add_argument("--capacity", type=int, default=10_000, help="ring slots (ring design)")
    ap.add_argument(
        "--rows-capacity",
        type=int,
        default=1024,
        help="pushes a ring of the rows layout holds, a multiple of 4 (ring-rows design)",
    )
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--payload-bytes", type=int, default=300)
    ap.add_argument("--baseline", type=int, default=1000, help="the reference sample: after this many")
    ap.add_argument("--report-every", type=int, default=1_000_000)
    ap.add_argument("--maintain-every", type=float, default=5.0, help="seconds (table design)")
    ap.add_argument(
        "--hold-after",
        type=float,
        help="hold the xmin horizon (a REPEATABLE READ snapshot on a session of its own) from this many "
        "seconds into the soak (with --hold-for)",
    )
    ap.add_argument("--hold-for", type=float, help="... for this many seconds")
    ap.add_argument(
        "--rate",
        type=float,
        help="messages a second the producers push in all (paced; default: as fast as they can)",
    )
    ap.add_argument("--dsn")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if (args.hold_after is None) != (args.hold_for is None):
        ap.error("--hold-after and --hold-for go together")
    if args.hold_for is not None and (args.hold_after < 0 or args.hold_for <= 0):
        ap.error("--hold-after must be >= 0 and --hold-for > 0")
    if min(args.messages, args.producers, args.consumers, args.batch, args.report_every) < 1:
        ap.error("--messages, --producers, --consumers, --batch and --report-every must be >= 1")
    if args.rate is not None and args.rate <= 0:
        ap.error("--rate must be > 0 (messages a second)")
    if args.payload_bytes < 16:
        ap.error("--payload-bytes must be >= 16 (a payload carries its producer and number)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with database(args.dsn) as (dsn, where):
        info = server_info(dsn)
        print(
            f"PostgreSQL {info['server_version']} ({where}) | {args.design}"
            + (f" of {args.capacity} slots" if args.design == "ring" else "")
            + (f" of {args.rows_capacity} pushes" if args.design == "ring-rows" else "")
            + f" | {args.producers}x{args.consumers} batch {args.batch} | {args.payload_bytes} B payloads"
            + f" | {args.messages:,} messages"
            + (
                f" | xmin horizon held from {args.hold_after:g} s for {args.hold_for:g} s"
                if args.hold_for is not None
                else ""
            ),
            file=sys.stderr,
        )
        print(HEADER + (HOLD_COLUMN if args.hold_for is not None else ""), file=sys.stderr)
        result = run(args, dsn)
    ok = valid(result, args.messages)
    if args.json:
        print(json.dumps(result))
    else:
        b = result["baseline"]
        print(
            f"{result['popped']:,} of {result['pushed']:,} pushed messages popped in {result['seconds']} s "
            f"({result['cycles_per_s'] or 0:,.0f}/s); "
            f"checksum {'equal' if result['checksum_ok'] else 'DIFFERENT'}; "
            f"lost {result['lost']}, duplicated {result['duplicated']}; "
            f"size after {b['messages'] if b else '-'} messages {b['total_bytes'] / 1e6 if b else 0:.2f} MB, "
            f"at the end x{result['final_size_ratio']}; longest pop {result['longest_pop_s']} s"
        )
        if result.get("rate_before_hold") is not None:
            print(
                f"msg/s: the minute before the hold {result['rate_before_hold']:,}, its last minute "
                f"{result['rate_hold_last_minute']}, the minute after {result['rate_after_hold']} "
                f"(kept {result['hold_kept']})"
            )
        for e in result["errors"]:
            print(f"error: {e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
