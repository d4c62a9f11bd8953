"""What made docs/bench/rows-held-steady-2026-11-29.jsonl: server instructions a message of a rows ring
in a steady state, without and with a held xmin horizon, in one server under cachegrind.

    PYTHONPATH=$PWD python docs/bench/rows-held-steady-2026-11-29.py BATCH CAPACITY CYCLES

``benchmarks/instructions.py`` pushes a whole session and then pops it, so its rows ring rotates a
segment only once its sessions have pushed more rows than it holds. Here one connection pushes a batch
and pops it, cycle after cycle, so that the ring rotates every capacity / 4 pushes as under a steady
load (capacity 212 is run.py's default for 2x2 batch 100: a rotation every 53 pushes). For each of
"not held" and "held" (a REPEATABLE READ transaction with an xid and a snapshot, as run.py's hold,
opened before the warm-up), on a fresh ring: a warm-up session of CYCLES cycles, then two pairs of
sessions of CYCLES and 4 x CYCLES cycles; a message costs (long - short) / (3 x CYCLES x BATCH). Every
session's payloads are counted and checksummed. Beside each pair: pg_class's updates and dead tuples
and size, and the segments' generations (the rotations).
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from cost import check, payloads  # benchmarks/ is a folder of scripts
from instructions import CountedServer, HeldHorizon, _pid, counted_server

from airflow_dbqueue.engine import DbQueue

PAIRS = 2


def session(dsn: str, schema: str, batch: int, cycles: int, tag: int) -> int:
    sent: list[list[bytes]] = []
    got: list[bytes] = []
    with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
        q = dbq.queue("q")
        q.reclaim_every = float("inf")  # type: ignore[attr-defined]
        pid = _pid(dbq)
        for k in range(cycles):
            b = payloads(batch, 300, tag, k)
            sent.append(b)
            q.push_batch(b)
            got.extend(q.pop_payloads(batch))
        assert _pid(dbq) == pid  # one backend: the one counted
    check(sent, got, "steady")
    return pid


def figures(dsn: str, schema: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT n_tup_upd, n_dead_tup, pg_relation_size('pg_class') FROM pg_stat_sys_tables "
            "WHERE relname = 'pg_class'"
        ).fetchone()
        assert row is not None
        [qid] = c.execute(f"SELECT queue_id FROM {schema}.ring_rows").fetchone() or [0]
        gens = [c.execute(f"SELECT last_value FROM {schema}.ring_{qid}_rgen{k}").fetchone() for k in range(4)]
    return {
        "pg_class_upd": row[0],
        "pg_class_dead": row[1],
        "pg_class_bytes": row[2],
        "gens": [g[0] if g else None for g in gens],
    }


def run(server: CountedServer, batch: int, capacity: int, cycles: int, held: bool) -> None:
    dsn = server.pg.dsn
    schema = f"st_{uuid.uuid4().hex[:8]}"
    with DbQueue(dsn, schema=schema) as dbq:
        dbq.install()
        dbq.create_queue(
            "q",
            design="ring",
            layout="rows",
            capacity=capacity,
            payload_type="bytes",
            max_payload_bytes=300,
            notify="never",
        )
    hold = HeldHorizon(dsn) if held else None
    server.counted({session(dsn, schema, batch, cycles, 0)})  # warm-up
    for pair in range(PAIRS):
        before = figures(dsn, schema)
        short = server.counted({session(dsn, schema, batch, cycles, 1 + 2 * pair)})
        long = server.counted({session(dsn, schema, batch, 4 * cycles, 2 + 2 * pair)})
        line = {
            "design": "ring-rows",
            "batch": batch,
            "capacity": capacity,
            "held": held,
            "pair": pair,
            "cycles": cycles,
            "per_msg": round((long - short) / (3 * cycles * batch)),
            "short_total": short,
            "long_total": long,
            "before": before,
            "after": figures(dsn, schema),
            "xmin_age": hold.age(dsn) if hold else None,
        }
        print(json.dumps(line), flush=True)
    if hold is not None:
        hold.release()
    with DbQueue(dsn, schema=schema) as dbq:
        dbq.uninstall()


def main() -> None:
    batch, capacity, cycles = map(int, sys.argv[1:4])
    with counted_server() as server:
        for held in (False, True):
            run(server, batch, capacity, cycles, held)


if __name__ == "__main__":
    main()
