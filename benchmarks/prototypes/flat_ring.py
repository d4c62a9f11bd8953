"""Drive the insert-only segment ring prototype (flat_ring.sql) and today's ring side by side.

For each design named, on one throwaway PostgreSQL 18 server (or --dsn): a fresh queue, 2 producer and 2
consumer processes (batch 100, 300-byte payloads that differ per message), a 1 s warm-up, then a
measured window, optionally with the xmin horizon held through it (a REPEATABLE READ transaction with an
xid and a snapshot, on a session of its own, reading only pg_class). Then the producers stop, the
consumers drain the queue, and every message is checked: the ids that went in came out exactly once,
and the sum of the payloads' CRC-32s matches.

Designs:
  ring          today's ring through the engine (DbQueue.create_queue(design="ring")), at most once
  ring-alo      the same, at least once (pop, then ack of what was popped)
  ring-rows     the engine's ring of the rows layout (create_queue(design="ring", layout="rows"),
                capacity 4 x --seg-rows pushes), at most once
  ring-rows-alo the same, at least once (pop, then ack of what was popped)
  flat-upd      insert-only segments, lane positions UPDATEd per pop (as ring_lanes)
  flat-log      insert-only segments, lane positions in an insert-only log
  flat-log-alo  flat-log at least once: a lease row per pop, an ack row per ack
  flat-rows     a row a push (its payloads in one array), lanes of rows, an insert-only position log
                (flat_rows.sql)
  flat-rows-alo flat-rows at least once: a lease row per pop, an ack row per ack

    PYTHONPATH=. python benchmarks/prototypes/flat_ring.py --designs ring,flat-log --seconds 30 --hold
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import struct
import sys
import tempfile
import time
import zlib
from array import array
from pathlib import Path
from typing import Any

import psycopg

BATCH = int(os.environ.get("FLAT_RING_BATCH", "100"))
"""Messages a push and a pop (--batch, passed to the spawned workers through the environment)."""
PAYLOAD = 300
SQL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flat_ring.sql")
ROWS_SQL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flat_rows.sql")


def make_payloads(who: int, counter: int, rnd: random.Random) -> tuple[list[bytes], int]:
    out, crc = [], 0
    for k in range(BATCH):
        mid = (who << 40) | (counter + k)
        p = struct.pack("<Q", mid) + rnd.randbytes(PAYLOAD - 8)
        out.append(p)
        crc += zlib.crc32(p)
    return out, crc


def producer(design: str, dsn: str, who: int, stop: Any, pushed: Any, res: Any) -> None:  # noqa: PLR0917 - a Process target's args
    rnd = random.Random(who * 7919)
    counter = crc = full_waits = rotations = 0
    variant = design.split("-")[1] if design.startswith("flat") else ""
    if design.startswith("ring"):
        from airflow_dbqueue.engine import DbQueue

        dbq = DbQueue(dsn)
        q = dbq.queue("r")
        while not stop.is_set():
            pl, c = make_payloads(who, counter, rnd)
            q.push_batch(pl)
            counter += BATCH
            crc += c
            with pushed.get_lock():
                pushed.value += BATCH
        dbq.close()
    else:
        conn = psycopg.connect(dsn, autocommit=True)
        s = design_schema(design)
        while not stop.is_set():
            pl, c = make_payloads(who, counter, rnd)
            while True:
                first, need = conn.execute(f"SELECT r_first, r_need FROM {s}.push(%b)", (pl,)).fetchone()
                if first is not None:
                    break
                if conn.execute(f"SELECT {s}.rotate(%s, %s)", (need, variant)).fetchone()[0]:
                    rotations += 1
                else:
                    full_waits += 1
                    time.sleep(0.002)
            counter += BATCH
            crc += c
            with pushed.get_lock():
                pushed.value += BATCH
        conn.close()
    res.put(("p", who, counter, crc, full_waits, rotations))


def consumer(design: str, dsn: str, who: int, stop: Any, popped: Any, res: Any) -> None:  # noqa: PLR0917 - a Process target's args
    ids = array("Q")
    crc = empty = 0
    alo = design.endswith("-alo")
    if design.startswith("ring"):
        from airflow_dbqueue.engine import DbQueue

        dbq = DbQueue(dsn)
        q = dbq.queue("r")
        while not stop.is_set():
            if alo:
                msgs = q.pop(BATCH, semantics="at-least-once", visibility_timeout=60)
                got = [m.payload for m in msgs]
            else:
                got = q.pop_payloads(BATCH)
            if not got:
                empty += 1
                time.sleep(0.001)
                continue
            if alo:
                q.ack(msgs)
            for p in got:
                ids.append(struct.unpack_from("<Q", p)[0])
                crc += zlib.crc32(p)
            with popped.get_lock():
                popped.value += len(got)
        dbq.close()
    else:
        conn = psycopg.connect(dsn, autocommit=True)
        s = design_schema(design)
        variant = design.split("-")[1]
        while not stop.is_set():
            rows = conn.execute(
                f"SELECT r_seq, r_payload FROM {s}.pop(%s, %s, %s, 60)", (BATCH, variant, alo)
            ).fetchall()
            if not rows:
                empty += 1
                time.sleep(0.001)
                continue
            if alo:
                assert conn.execute(f"SELECT {s}.ack(%s)", (rows[0][0],)).fetchone()[0]
            for _, p in rows:
                ids.append(struct.unpack_from("<Q", p)[0])
                crc += zlib.crc32(p)
            with popped.get_lock():
                popped.value += len(rows)
        conn.close()
    res.put(("c", who, ids.tobytes(), crc, empty))


def design_schema(design: str) -> str:
    return "flat_" + design.split("-")[1]


def setup(design: str, dsn: str, capacity: int, seg_size: int, lanes: int, *, seg_rows: int = 256) -> str:
    """A fresh queue for the design; returns the schema whose tables are measured."""
    with psycopg.connect(dsn, autocommit=True) as c:
        if design.startswith("ring"):
            from airflow_dbqueue.engine import DbQueue

            with DbQueue(dsn) as dbq:
                dbq.install()
                dbq.drop_queue("r", missing_ok=True)
                rows = design.startswith("ring-rows")
                dbq.create_queue(
                    "r",
                    design="ring",
                    capacity=4 * seg_rows if rows else capacity,
                    payload_type="bytes",
                    max_payload_bytes=512,
                    **({"layout": "rows"} if rows else {}),
                )
            c.execute("VACUUM")
            return "dbqueue"
        s = design_schema(design)
        c.execute(f"DROP SCHEMA IF EXISTS {s} CASCADE")
        sql = (
            Path(ROWS_SQL if design.startswith("flat-rows") else SQL)
            .read_text()
            .replace("{s}", s)
            .replace("{seg_rows}", str(seg_rows))
            .replace("{lanes}", str(lanes))
            .replace("{seg_size}", str(seg_size))
        )
        c.execute(sql)
        c.execute("VACUUM")
        return s


def table_stats(dsn: str, schema: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT pg_stat_force_next_flush()")
        mb = c.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) / 1048576.0 FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind IN ('r', 'm')",
            (schema,),
        ).fetchone()[0]
        dead = c.execute(
            "SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(n_tup_ins), 0), coalesce(sum(n_tup_upd), 0), "
            "coalesce(sum(n_tup_del), 0) FROM pg_stat_user_tables WHERE schemaname = %s",
            (schema,),
        ).fetchone()
        cat = c.execute(
            "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_sys_tables WHERE schemaname = 'pg_catalog'"
        ).fetchone()[0]
        catmb = c.execute("SELECT pg_total_relation_size('pg_class') / 1048576.0").fetchone()[0]
    return {
        "mb": round(float(mb), 2),
        "dead": int(dead[0]),
        "ins": int(dead[1]),
        "upd": int(dead[2]),
        "del": int(dead[3]),
        "catalog_dead": int(cat),
        "pg_class_mb": round(float(catmb), 2),
    }


def run_one(args: argparse.Namespace, design: str, hold: bool) -> dict[str, Any]:  # noqa: PLR0915 - one run told in order
    schema = setup(design, args.dsn, args.capacity, args.seg_size, args.lanes, seg_rows=args.seg_rows)
    ctx = mp.get_context("spawn")
    pushed, popped = ctx.Value("q", 0), ctx.Value("q", 0)
    stop_p, stop_c, res = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=producer, args=(design, args.dsn, w, stop_p, pushed, res))
        for w in range(args.producers)
    ]
    procs += [
        ctx.Process(target=consumer, args=(design, args.dsn, w, stop_c, popped, res))
        for w in range(args.consumers)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0 + 1.5)  # the processes' start (spawn, imports), then a 1 s warm-up
    before = table_stats(args.dsn, schema)
    holder = None
    if hold:
        holder = psycopg.connect(args.dsn)
        holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        holder.execute("SELECT txid_current()").fetchone()
        holder.execute("SELECT count(*) FROM pg_catalog.pg_class").fetchone()
    t0 = time.monotonic()
    samples = [(0.0, popped.value)]
    for k in range(1, int(args.seconds) + 1):
        time.sleep(max(0.0, t0 + k - time.monotonic()))
        samples.append((time.monotonic() - t0, popped.value))
    window = samples[-1][0]
    at_end = table_stats(args.dsn, schema)
    load = os.getloadavg()
    xmin_age = None
    if holder is not None:
        with psycopg.connect(args.dsn, autocommit=True) as c:
            xmin_age = c.execute(
                "SELECT max(age(backend_xmin)) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL"
            ).fetchone()[0]
        holder.rollback()
        holder.close()
    stop_p.set()
    got: dict[str, list[Any]] = {"p": [], "c": []}
    while len(got["p"]) < args.producers:
        r = res.get(timeout=120)
        got[r[0]].append(r)
    deadline = time.monotonic() + 120
    while popped.value < pushed.value and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_c.set()
    while len(got["c"]) < args.consumers:
        r = res.get(timeout=120)
        got[r[0]].append(r)
    for p in procs:
        p.join(timeout=30)
    # Every message once: the ids out are exactly the ids in, and the payloads' CRC sums match.
    want = set()
    for _, who, n, _, _, _ in got["p"]:
        want.update((who << 40) | k for k in range(n))
    out = array("Q")
    for r in got["c"]:
        a = array("Q")
        a.frombytes(r[2])
        out.extend(a)
    out_set = set(out)
    crc_in = sum(r[3] for r in got["p"])
    crc_out = sum(r[3] for r in got["c"])
    per_s = [
        (samples[i][1] - samples[i - 1][1]) / (samples[i][0] - samples[i - 1][0])
        for i in range(1, len(samples))
    ]
    edge = min(10, len(per_s) // 3)
    return {
        "design": design,
        "hold": hold,
        "seconds": round(window, 1),
        "msgs_per_s": round((samples[-1][1] - samples[0][1]) / window),
        "first_10s": round(sum(per_s[:edge]) / edge),
        "last_10s": round(sum(per_s[-edge:]) / edge),
        "per_s": [round(x) for x in per_s],
        "before": before,
        "at_end": at_end,
        "after_drain": table_stats(args.dsn, schema),
        "xmin_age_at_end": xmin_age,
        "loadavg_at_end": [round(x, 2) for x in load],
        "pushed": len(want),
        "popped": len(out),
        "lost": len(want - out_set),
        "duplicated": len(out) - len(out_set),
        "foreign": len(out_set - want),
        "crc_ok": crc_in == crc_out,
        "full_waits": sum(r[4] for r in got["p"]),
        "rotations": sum(r[5] for r in got["p"]),
        "empty_pops": sum(r[4] for r in got["c"]),
    }


def main() -> None:
    global BATCH  # the workers are spawned: they read it from the environment
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", default="ring,flat-upd,flat-log")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--hold", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--dsn", help="a server to use (default: an embedded PostgreSQL 18 of its own)")
    ap.add_argument("--capacity", type=int, default=16384, help="today's ring's capacity")
    ap.add_argument("--seg-size", type=int, default=16384, help="numbers per segment (4 segments)")
    ap.add_argument("--seg-rows", type=int, default=256, help="rows (pushes) per segment of flat-rows")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--out", help="append the JSON lines here too")
    ap.add_argument("--batch", type=int, default=BATCH, help="messages a push and a pop (default 100)")
    args = ap.parse_args()
    BATCH = args.batch
    os.environ["FLAT_RING_BATCH"] = str(args.batch)
    server = None
    if not args.dsn:
        from airflow_dbqueue.engine.embedded import EmbeddedPostgres

        server = EmbeddedPostgres(tempfile.mkdtemp(prefix="flatring-"))
        args.dsn = server.start()
    try:
        holds = {"no": [False], "yes": [True], "both": [False, True]}[args.hold]
        for design in args.designs.split(","):
            for hold in holds:
                r = run_one(args, design, hold)
                r["batch"] = BATCH
                line = json.dumps(r)
                print(
                    f"{design:13} hold={hold!s:5} {r['msgs_per_s']:>7}/s first10 {r['first_10s']:>7} last10 "
                    f"{r['last_10s']:>7} MB {r['before']['mb']}->{r['at_end']['mb']} "
                    f"dead {r['at_end']['dead']} "
                    f"catdead {r['at_end']['catalog_dead']} lost {r['lost']} dup {r['duplicated']} "
                    f"crc {r['crc_ok']} load {r['loadavg_at_end']}",
                    file=sys.stderr,
                    flush=True,
                )
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
