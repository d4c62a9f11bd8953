"""What made docs/bench/rows-held-explain-2026-11-29.jsonl: EXPLAIN (ANALYZE, BUFFERS) of the rows ring's
reads after a steady load, without and with a held xmin horizon, on an embedded PostgreSQL of its own.

    PYTHONPATH=$PWD python docs/bench/rows-held-explain-2026-11-29.py DATA_DIR

For each of "not held" and "held" (a REPEATABLE READ transaction with an xid and a snapshot, opened
before the load): a fresh rows ring of capacity 212 pushes, 1,500 pushes of 100 messages with a pop of
100 after each from the eleventh on (about 10 pushes stay queued), then the plans and buffers of: a lane's
position (the newest segment of the log), the newest segment's rows from ten before the last, one row's
payloads, and a ring table's pg_class row by oid; the ring's tables' statistics, and pg_class's updates,
dead tuples and size before and after.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from cost import payloads  # benchmarks/ is a folder of scripts

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.embedded import EmbeddedPostgres, free_port

CLASS = (
    "SELECT n_tup_upd, n_dead_tup, pg_relation_size('pg_class'), pg_relation_size('pg_class_oid_index') "
    "FROM pg_stat_sys_tables WHERE relname = 'pg_class'"
)


def one(dsn: str, held: bool) -> dict[str, Any]:
    schema = f"ex_{uuid.uuid4().hex[:8]}"
    with DbQueue(dsn, schema=schema) as dbq:
        dbq.install()
        dbq.create_queue(
            "q",
            design="ring",
            layout="rows",
            capacity=212,
            payload_type="bytes",
            max_payload_bytes=300,
            notify="never",
        )
    holder = None
    if held:
        holder = psycopg.connect(dsn)
        holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        holder.execute("SELECT txid_current()")
        holder.execute("SELECT count(*) FROM pg_class").fetchone()
    with psycopg.connect(dsn, autocommit=True) as c:
        class_before = c.execute(CLASS).fetchone()
    with DbQueue(dsn, schema=schema, pool_size=1) as dbq:
        q = dbq.queue("q")
        for k in range(1500):
            q.push_batch(payloads(100, 300, 0, k))
            if k >= 10:
                assert len(q.pop_payloads(100)) == 100
    with psycopg.connect(dsn, autocommit=True) as c:
        [qid] = c.execute(f"SELECT queue_id FROM {schema}.ring_rows").fetchone() or [0]
        seq = f"{schema}.ring_{qid}_r"
        gens = [c.execute(f"SELECT last_value FROM {seq}gen{k}").fetchone() for k in range(4)]
        [posgen] = c.execute(f"SELECT last_value FROM {seq}posgen").fetchone() or [0]
        [last] = c.execute(f"SELECT last_value FROM {seq}rows").fetchone() or [0]
        seg = (last // 53) % 4
        statements = {
            "pos_max": f"SELECT max(p.at) FROM {seq}pos{posgen % 4} p WHERE p.lane = 3",
            "seg_rows": f"SELECT t.r, t.n FROM {seq}q{seg} t WHERE t.r >= {last - 9} "
            f"AND t.r < {last // 53 * 53 + 53} ORDER BY t.r",
            "row_payload": f"SELECT t.payloads[1:100], t.enqueued_at FROM {seq}q{seg} t "
            f"WHERE t.r = {last - 5}",
            "pg_class_by_oid": f"SELECT relfilenode FROM pg_class WHERE oid = '{seq}q0'::regclass",
        }
        plans = {}
        for name, stmt in statements.items():
            # pg_class's row by its oid index, as the caches look it up
            c.execute(f"SET enable_seqscan = {'off' if name == 'pg_class_by_oid' else 'on'}")
            plans[name] = [
                r[0]
                for r in c.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY OFF) " + stmt
                ).fetchall()
            ]
            c.execute("RESET enable_seqscan")
        tables = c.execute(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del, n_dead_tup, n_live_tup "
            "FROM pg_stat_user_tables WHERE schemaname = %s AND n_tup_ins > 0 ORDER BY relname",
            (schema,),
        ).fetchall()
        out = {
            "held": held,
            "gens": [g[0] if g else None for g in gens],
            "last_row": last,
            "plans": plans,
            "tables": tables,
            "pg_class_before": class_before,
            "pg_class_after": c.execute(CLASS).fetchone(),
        }
    if holder is not None:
        holder.rollback()
        holder.close()
    with DbQueue(dsn, schema=schema) as dbq:
        dbq.uninstall()
    return out


def main() -> None:
    pg = EmbeddedPostgres(Path(sys.argv[1]), port=free_port())
    dsn = pg.start()
    try:
        for held in (False, True):
            print(json.dumps(one(dsn, held), default=str), flush=True)
    finally:
        pg.stop()


if __name__ == "__main__":
    main()
