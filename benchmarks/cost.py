#!/usr/bin/env python
"""Per-message cost: client CPU, server CPU and WAL of each side of a queue, on one connection.

    python benchmarks/cost.py [--batch 1000] [--batches 100] [--rounds 3] [--design ring] [--json]
                              [--semantics at-least-once] [--archive]

Where ``run.py`` measures what P producers and C consumers achieve together, this takes a queue
apart: one process pushes ``--batches`` batches, then pops them, through the engine's API (the design
given), then does the same with the naive baseline's statements (``run.py``'s, binary arrays and
rows), and prints per message:

* client CPU of this process (``time.process_time``);
* server CPU of the whole PostgreSQL server: every process of the server the connection reaches,
  read from ``/proc`` (its backends, WAL writer, autovacuum), so only for a server on this machine;
  with a remote one the column is ``-``;
* WAL bytes (``pg_current_wal_insert_lsn``).

Rounds alternate between the design and the baseline; the table gives the median of the rounds and
the design's ratio to the baseline of the same run (above 1: the design costs more). Nothing is lost:
every pop's count and payload checksum is compared with what was pushed, and the run fails otherwise.
With ``--semantics at-least-once`` the design's pop side is a pop at least once and an ack of what it
took (the naive queue's pop stays its one DELETE); ``--archive`` creates a table-design queue that
archives (finished messages kept in ``done``). The database is ``--dsn``, else ``$DBQUEUE_TEST_DSN``,
else a throwaway embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.backends import naive_statements
from payloads import fillers, make
from run import database, server_info  # benchmarks/ is a folder of scripts
from soak import MASK
from soak import digest as payload_digest

from airflow_dbqueue.engine import DbQueue

QUEUE = "cost_q"
SIDES = ("push", "pop")
_TICK = os.sysconf("SC_CLK_TCK")


def server_cpu_reader(conn: psycopg.Connection[Any]) -> Callable[[], float] | None:
    """A function returning the CPU seconds used so far by every process of ``conn``'s server, or
    None when the server is not on this machine (its backend's process is not in ``/proc``)."""
    pid = conn.info.backend_pid
    try:
        with open(f"/proc/{pid}/stat") as f:
            postmaster = int(f.read().rsplit(")", 1)[1].split()[1])  # the backend's parent
        with open(f"/proc/{postmaster}/cmdline", "rb") as cmd:
            if b"postgres" not in cmd.read():
                return None
    except (OSError, ValueError, IndexError):
        return None

    def read() -> float:
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # the process ended meanwhile
            if int(entry) == postmaster or int(fields[1]) == postmaster:
                total += int(fields[11]) + int(fields[12])  # utime + stime
        return total / _TICK

    return read


def digest(payloads: list[bytes]) -> int:
    """A checksum of a multiset of payloads (the order of pops does not matter), as soak.py sums them."""
    return sum(map(payload_digest, payloads)) & MASK


class Meter:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.server = server_cpu_reader(conn)

    def wal(self) -> int:
        row = self.conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
        assert row is not None
        return int(row[0])

    def measure(self, fn: Callable[[], int]) -> dict[str, float | None]:
        s0 = self.server() if self.server else None
        w0, c0 = self.wal(), time.process_time()
        n = fn()
        c1, w1 = time.process_time(), self.wal()
        s1 = self.server() if self.server else None
        return {
            "client_us": 1e6 * (c1 - c0) / n,
            "server_us": None if s0 is None or s1 is None else 1e6 * (s1 - s0) / n,
            "wal_bytes": (w1 - w0) / n,
        }


HEADER = struct.Struct(">qQ")  # (round, number), then a random filler (payloads.py)


def payloads(batch: int, size: int, round_no: int, k: int) -> list[bytes]:
    pool = fillers(size, HEADER.size)
    return [make(HEADER, pool, round_no, k * batch + i) for i in range(batch)]


def engine_round(dbq: DbQueue, meter: Meter, args: argparse.Namespace, r: int) -> dict[str, Any]:
    q = dbq.queue(QUEUE)
    sent = [payloads(args.batch, args.payload_bytes, r, k) for k in range(args.batches)]
    got: list[bytes] = []
    n: int = args.batch * args.batches

    def push() -> int:
        for batch in sent:
            if args.batch == 1:
                q.push(batch[0])
            else:
                q.push_batch(batch)
        return n

    def pop() -> int:
        for _ in range(args.batches):
            if args.semantics == "at-least-once":
                messages = q.pop(args.batch, semantics="at-least-once")
                q.ack(messages)
                got.extend(m.payload for m in messages)
            else:
                got.extend(q.pop_payloads(args.batch))
        return n

    out = {"push": meter.measure(push), "pop": meter.measure(pop)}
    check(sent, got, args.design)
    return out


def naive_round(
    conn: psycopg.Connection[Any], meter: Meter, args: argparse.Namespace, r: int, schema: str
) -> dict[str, Any]:
    push_sql, pop_sql = naive_statements(schema)  # run.py's, in binary
    sent = [payloads(args.batch, args.payload_bytes, r, k) for k in range(args.batches)]
    got: list[bytes] = []
    n: int = args.batch * args.batches

    def push() -> int:
        for batch in sent:
            conn.execute(push_sql, (batch,), prepare=True)
        return n

    def pop() -> int:
        for _ in range(args.batches):
            got.extend(row[0] for row in conn.execute(pop_sql, (args.batch,), prepare=True, binary=True))
        return n

    out = {"push": meter.measure(push), "pop": meter.measure(pop)}
    check(sent, got, "naive")
    return out


def check(sent: list[list[bytes]], got: list[bytes], who: str) -> None:
    flat = [p for batch in sent for p in batch]
    if len(got) != len(flat):
        raise SystemExit(f"{who}: pushed {len(flat)} messages, popped {len(got)}")
    if digest(got) != digest(flat):
        raise SystemExit(f"{who}: pushed and popped {len(flat)} messages, but their checksums differ")


def median(rounds: list[dict[str, Any]], side: str, key: str) -> float | None:
    values = [r[side][key] for r in rounds if r[side][key] is not None]
    return statistics.median(values) if values else None


def run(args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    schema = f"cost_{uuid.uuid4().hex[:10]}"
    with (
        DbQueue(dsn, schema=schema, pool_size=1) as dbq,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        dbq.install()
        naive_name = f"{schema}_naive"
        naive_schema = sql.Identifier(naive_name)
        try:
            if args.design == "ring":
                capacity = max(args.batch * args.batches, 1024)
                dbq.create_queue(
                    QUEUE,
                    design="ring",
                    layout="slots",
                    capacity=capacity,
                    payload_type="bytes",
                    max_payload_bytes=max(args.payload_bytes, 16),
                    notify="never",
                )
            else:
                dbq.create_queue(QUEUE, payload_type="bytes", notify="never", archive=args.archive)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(naive_schema))
            table = sql.SQL("CREATE TABLE {}.t (id bigserial PRIMARY KEY, payload bytea NOT NULL)")
            conn.execute(table.format(naive_schema))
            meter = Meter(conn)
            engine: list[dict[str, Any]] = []
            naive: list[dict[str, Any]] = []
            engine_round(dbq, meter, args, -1)  # warm-up: plans, caches, the ring's first lap
            naive_round(conn, meter, args, -1, naive_name)
            for r in range(args.rounds):
                engine.append(engine_round(dbq, meter, args, r))
                naive.append(naive_round(conn, meter, args, r, naive_name))
        finally:
            dbq.uninstall()
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(naive_schema))
    result: dict[str, Any] = {
        "design": args.design,
        "batch": args.batch,
        "messages_per_round": args.batch * args.batches,
        "rounds": args.rounds,
        "payload_bytes": args.payload_bytes,
        "semantics": args.semantics,
        "archive": args.archive,
        "server_cpu": meter.server is not None,
    }
    for side in SIDES:
        for key in ("client_us", "server_us", "wal_bytes"):
            result[f"{side}_{key}"] = median(engine, side, key)
            result[f"naive_{side}_{key}"] = median(naive, side, key)
    for key in ("client_us", "server_us", "wal_bytes"):
        d = [result[f"{s}_{key}"] for s in SIDES]
        b = [result[f"naive_{s}_{key}"] for s in SIDES]
        result[f"cycle_{key}"] = None if None in d else sum(d)
        result[f"naive_cycle_{key}"] = None if None in b else sum(b)
    return result


def table(r: dict[str, Any]) -> str:
    def fmt(v: float | None, digits: int = 2) -> str:
        return "-" if v is None else f"{v:,.{digits}f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}"

    lines = [
        f"per message, {r['semantics']}{', archive' if r['archive'] else ''}, batch {r['batch']}, "
        f"{r['payload_bytes']}-byte payloads, median of "
        f"{r['rounds']} rounds of {r['messages_per_round']:,} messages, one connection",
        f"{'side':6}  {'measure':12}  {r['design']:>9}  {'naive':>9}  {'ratio':>6}",
    ]
    for side in (*SIDES, "cycle"):
        for key, label, digits in (
            ("client_us", "client us", 2),
            ("server_us", "server us", 2),
            ("wal_bytes", "WAL bytes", 0),
        ):
            a, b = r[f"{side}_{key}"], r[f"naive_{side}_{key}"]
            lines.append(f"{side:6}  {label:12}  {fmt(a, digits):>9}  {fmt(b, digits):>9}  {ratio(a, b):>6}")
    if not r["server_cpu"]:
        lines.append("server CPU: the server is not on this machine, so it is not measured")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Per-message client CPU, server CPU and WAL of a design against the naive queue."
    )
    ap.add_argument("--design", choices=("ring", "table"), default="ring")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=100, help="batches pushed, then popped, per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--payload-bytes", type=int, default=300)
    ap.add_argument(
        "--semantics",
        choices=("at-most-once", "at-least-once"),
        default="at-most-once",
        help="the design's pop side: a pop at most once, or a pop at least once and an ack",
    )
    ap.add_argument("--archive", action="store_true", help="a table-design queue that archives")
    ap.add_argument("--dsn")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.batches < 1 or args.rounds < 1 or args.payload_bytes < 16:
        ap.error("--batch, --batches and --rounds must be >= 1, --payload-bytes >= 16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with database(args.dsn) as (dsn, where):
        info = server_info(dsn)
        result = run(args, dsn)
    if args.json:
        print(json.dumps({**result, "server": info, "where": where}))
    else:
        print(
            f"PostgreSQL {info['server_version']} ({where}; synchronous_commit={info['synchronous_commit']})"
        )
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
