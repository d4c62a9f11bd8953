#!/usr/bin/env python
"""Server instructions a pop at depth, with pops since the last VACUUM: scale.py's depth point, counted.

    python benchmarks/depth_count.py [--depth 1000000] [--batch 100] [--calls 4] [--json]

``scale.py --points depth`` times the pops of a deep queue against the naive queue, and on a shared
machine its figures move with the load. This builds the same state and counts instead: a throwaway
PostgreSQL is filled as scale.py's depth point fills it (the engine's queue with the engine defaults
and the naive queue, each pushed ``1.5 x --depth`` messages of ``--payload-bytes``, VACUUMed, then
``depth / 2`` of each popped, autovacuum off for both sides' tables so that every popped message's
index entry stays until the end), stopped, and started again under valgrind's cachegrind, as
instructions.py runs it. Then, for each side, a pop session of ``--calls`` pops of ``--batch`` and one of
four times as many, each one connection that pops and closes:

    instructions a message = (long session - short session) / (3 x calls x batch)

(a session of one pop runs first on each side, so that both counted sessions find the pages in
shared buffers). Every popped payload is checked against its header (scale.py's ``Counter``).

Before the restart, the claim of each side is explained on the filled server (``EXPLAIN (ANALYZE,
BUFFERS)`` of the statement that finds the next ``--batch`` messages, read only: the engine's with the
generic plan its functions use): the index pages it reads and, for the engine, the pages of each
partition's ready index. These say where a pop at depth spends its instructions: walking the index
entries of the messages popped since the last VACUUM, which the pops marked dead but which stay on
their pages until a VACUUM (or, for the engine, a partition's TRUNCATE) removes them. The engine's claim
is explained and counted a second way, bounded below by the process-at time of the queue's first ready
message (a what-if: what the claim would cost if it knew where its queue's live entries start).

Where the engine keeps a floor a queue (functions.sql's table_floor, raised by the partition
recycling), the fill ends with two raises of it, as two passes of a DbQueue's own recycling would make
(the first makes the queue's floor sequence, the second sets it), and the engine's claim is explained
and counted with its bound, as table_take() runs it (``floor`` in the output says whether it had one).
Pushes are counted too, after the pops, as the pops are: a push of ``--batch`` on each side, the
engine's with its defaults (``notify="auto"``).

Needs valgrind and the embedded server's binaries, as instructions.py. At the default depth the fill
takes a minute or two and the counted sessions a few minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.backends import naive_statements  # benchmarks/ is a folder of scripts
from instructions import CountedServer
from scale import Counter

from airflow_dbqueue.engine import DbQueue

QUEUE = "depth"
FILL_BATCH = 1000
# The engine's claim as table_take() runs it (functions.sql): its generic plan, no sequential or bitmap
# scans, read only here (no FOR UPDATE), so that explaining it takes nothing.
ENGINE_CLAIM = """
    SELECT s.gen, s.ctid FROM {schema}.meta s
    WHERE s.queue_id = $1 AND s.state = 0 AND s.process_at <= now()
    ORDER BY s.priority DESC, s.process_at, s.id
    LIMIT $2"""
# The same claim bounded below by the process-at time of the queue's first ready message ($3): what a claim
# would cost if it knew where the live entries of its queue start (a what-if: the engine has no such
# bound). With the skip scan over priority of PostgreSQL 18 the bound is where each priority's scan
# starts, so it passes none of the entries of the messages popped before.
ENGINE_BOUNDED_CLAIM = """
    SELECT s.gen, s.ctid FROM {schema}.meta s
    WHERE s.queue_id = $1 AND s.state = 0 AND s.process_at <= now() AND s.process_at >= $3
    ORDER BY s.priority DESC, s.process_at, s.id
    LIMIT $2"""
NAIVE_CLAIM = "SELECT id FROM {schema}.t ORDER BY id LIMIT $1"
# The what-if pop: table_take()'s pop with the archive (functions.sql, the engine default) whose claim is
# bounded below by a floor read from a sequence (microseconds since the epoch), in a schema of its own
# ({w}), not engine code. It models a design in which every ready message of a queue has a process-at
# time at or above its queue's floor (writers would clamp to it; maintenance would raise it): a sequence,
# because it is read without a snapshot and written without a row version. Here the floor is set by hand
# to the first ready message's time before the counted sessions, so this counts what such a pop costs,
# floor read included, and nothing of what keeping the floor true would cost.
FLOOR_SQL = """
CREATE SCHEMA {w};
CREATE SEQUENCE {w}.floor AS bigint MINVALUE 0;
CREATE FUNCTION {w}.take(p_queue_id integer, p_n integer)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE
    v_floor timestamptz := (
        SELECT timestamptz 'epoch' + f.last_value * interval '1 microsecond' FROM {w}.floor f);
BEGIN
    RETURN QUERY
    WITH taken AS (
        DELETE FROM {s}.meta m
        USING (
            SELECT s.gen, s.ctid AS tid FROM {s}.meta s
            WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now()
              AND s.process_at >= v_floor
            ORDER BY s.priority DESC, s.process_at, s.id
            LIMIT p_n
            FOR UPDATE SKIP LOCKED) c
        WHERE m.gen = c.gen AND m.ctid = c.tid
        RETURNING m.id, m.queue_id, m.priority, m.attempts + 1 AS attempts,
                  m.deliveries + 1 AS deliveries, m.enqueued_at, m.payload, m.gen
    ), kept AS (
        INSERT INTO {s}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload, gen)
        SELECT t.id, t.queue_id, t.priority, t.attempts, t.enqueued_at, 1, t.payload, t.gen FROM taken t
    )
    SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz,
           coalesce(t.payload, (SELECT d.payload FROM {s}.data d WHERE d.id = t.id AND d.gen = t.gen))
    FROM taken t;
END
$$;
"""
CLAIM_SETTINGS = (
    "SET plan_cache_mode = force_generic_plan",
    "SET enable_seqscan = off",
    "SET enable_bitmapscan = off",
)


def fill(dsn: str, schema: str, depth: int, payload_bytes: int) -> tuple[Counter, Counter]:
    """scale.py's depth point up to its timed calls: both queues filled, VACUUMed, half of the depth
    popped, autovacuum off for their tables."""
    engine, naive = Counter(0, payload_bytes), Counter(1, payload_bytes)
    naive_schema = schema + "_naive"
    push_sql, pop_sql = naive_statements(naive_schema)
    with (
        DbQueue(dsn, schema=schema, recycle_interval=None) as dbq,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        dbq.install()
        q = dbq.create_queue(QUEUE, payload_type="bytes")  # engine defaults otherwise
        s = sql.Identifier(naive_schema)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        conn.execute(
            sql.SQL("CREATE TABLE {}.t (id bigserial PRIMARY KEY, payload bytea NOT NULL)").format(s)
        )
        conn.execute(sql.SQL("ALTER TABLE {}.t SET (autovacuum_enabled = false)").format(s))
        for table in ("meta", "data", "done"):
            for g in range(8):
                conn.execute(
                    sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(
                        sql.Identifier(schema, f"{table}_{g}")
                    )
                )
        for _ in range(0, depth + depth // 2, FILL_BATCH):
            q.push_batch(engine.batch(FILL_BATCH))
            conn.execute(push_sql, (naive.batch(FILL_BATCH),))
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}.t").format(s))
        for table in ("meta", "data", "done"):
            conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(schema, table)))
        popped = 0
        while popped < depth // 2:
            n = min(FILL_BATCH, depth // 2 - popped)
            if engine.took(q.pop_payloads(n)) != n:
                raise SystemExit("the engine's queue gave fewer messages than it holds")
            if naive.took([r[0] for r in conn.execute(pop_sql, (n,), binary=True).fetchall()]) != n:
                raise SystemExit("the naive queue gave fewer messages than it holds")
            popped += n
    return engine, naive


def _blocks(node: dict[str, Any]) -> int:
    return int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))


def _scans(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node] if node.get("Node Type") == "Index Scan" else []
    for child in node.get("Plans", []):
        out.extend(_scans(child))
    return out


def has_floor(dsn: str, schema: str) -> bool:
    """Whether the engine under test keeps a floor a queue (functions.sql's table_raise_floors)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT to_regprocedure(%s) IS NOT NULL", (f"{schema}.table_raise_floors()",)
        ).fetchone()
    return bool(row and row[0])


def raise_floor(dsn: str, schema: str) -> str | None:
    """Two raises of the engine's floors (the first makes the queue's sequence, the second sets it), as two
    passes of the recycling would make them; the queue's floor then (text), or None without one."""
    with psycopg.connect(dsn, autocommit=True) as c:
        for _ in range(2):
            c.execute(sql.SQL("SELECT {}.table_raise_floors()").format(sql.Identifier(schema)))
        row = c.execute(
            sql.SQL("SELECT {s}.table_floor(q.queue_id)::text FROM {s}.queues q WHERE q.name = %s").format(
                s=sql.Identifier(schema)
            ),
            (QUEUE,),
        ).fetchone()
    return str(row[0]) if row else None


def claim_statements(dsn: str, schema: str, batch: int) -> list[tuple[str, str, str]]:
    """Each side's claim, read only: (side, its PREPARE, its EXECUTE). The engine's is bounded by its
    queue's floor where the engine keeps one, as table_take() bounds it."""
    floor = None
    if has_floor(dsn, schema):
        with psycopg.connect(dsn, autocommit=True) as c:
            row = c.execute(
                sql.SQL(
                    "SELECT {s}.table_floor(q.queue_id)::text FROM {s}.queues q WHERE q.name = %s"
                ).format(s=sql.Identifier(schema)),
                (QUEUE,),
            ).fetchone()
        floor = row[0] if row else None
    with psycopg.connect(dsn, autocommit=True) as c:
        qid = c.execute(
            sql.SQL("SELECT queue_id FROM {}.queues WHERE name = %s").format(sql.Identifier(schema)), (QUEUE,)
        ).fetchone()
        assert qid is not None
        if floor is None:
            engine = sql.SQL("PREPARE engine_claim(integer, integer) AS " + ENGINE_CLAIM).format(
                schema=sql.Identifier(schema)
            )
            engine_call = f"EXECUTE engine_claim({int(qid[0])}, {batch})"
        else:
            engine = sql.SQL(
                "PREPARE engine_claim(integer, integer, timestamptz) AS " + ENGINE_BOUNDED_CLAIM
            ).format(schema=sql.Identifier(schema))
            engine_call = f"EXECUTE engine_claim({int(qid[0])}, {batch}, '{floor}')"
        bounded = sql.SQL(
            "PREPARE engine_bounded_claim(integer, integer, timestamptz) AS " + ENGINE_BOUNDED_CLAIM
        ).format(schema=sql.Identifier(schema))
        naive = sql.SQL("PREPARE naive_claim(integer) AS " + NAIVE_CLAIM).format(
            schema=sql.Identifier(schema + "_naive")
        )
        first = c.execute(
            sql.SQL("SELECT min(process_at)::text FROM {}.meta WHERE queue_id = %s AND state = 0").format(
                sql.Identifier(schema)
            ),
            (qid[0],),
        ).fetchone()
        assert first is not None and first[0] is not None
        return [
            ("engine", engine.as_string(c), engine_call),
            (
                "engine_bounded",
                bounded.as_string(c),
                f"EXECUTE engine_bounded_claim({int(qid[0])}, {batch}, '{first[0]}')",
            ),
            ("naive", naive.as_string(c), f"EXECUTE naive_claim({batch})"),
        ]


def explain_claims(dsn: str, schema: str, batch: int) -> dict[str, Any]:
    """Index pages each side's claim reads (the second of two runs, so that both find their pages in
    shared buffers), and the engine's per partition."""
    with psycopg.connect(dsn, autocommit=True) as c:
        for s in CLAIM_SETTINGS:
            c.execute(s)
        plans = {}
        for name, prepare, call in claim_statements(dsn, schema, batch):
            c.execute(prepare)
            for _ in range(2):
                row = c.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + call).fetchone()
            assert row is not None
            plans[name] = row[0][0]["Plan"]
    engine_scans = _scans(plans["engine"])
    return {
        "engine_claim_pages": _blocks(plans["engine"]),
        "engine_claim_pages_by_partition": {s["Relation Name"]: _blocks(s) for s in engine_scans},
        "engine_claim_index_searches": sum(int(s.get("Index Searches", 1)) for s in engine_scans),
        "engine_bounded_claim_pages": _blocks(plans["engine_bounded"]),
        "naive_claim_pages": _blocks(plans["naive"]),
    }


def per_call(server: CountedServer, session: Callable[[int], set[int]], calls: int) -> float:
    """Server instructions a call of ``session``'s loop: a session of one call first (so that the counted
    ones find the pages in shared buffers), then (a session of ``4 x calls`` - one of ``calls``) /
    ``3 x calls``, which leaves out each session's connection and set-up."""
    server.counted(session(1))
    short = server.counted(session(calls))
    long = server.counted(session(4 * calls))
    return (long - short) / (3 * calls)


def count_pops(
    server: CountedServer, dsn: str, schema: str, *, batch: int, calls: int, who: str, counter: Counter
) -> float:
    """Server instructions a message of a pop of ``batch`` on side ``who`` (see the docstring)."""

    def session(n: int) -> set[int]:
        if who == "engine":
            with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
                q = dbq.queue(QUEUE)
                q.reclaim_every = float("inf")  # type: ignore[attr-defined] # no reclaim between pops
                with dbq.db.connection() as c:  # type: ignore[attr-defined]
                    pids = {int(c.info.backend_pid)}
                for _ in range(n):
                    if counter.took(q.pop_payloads(batch)) != batch:
                        raise SystemExit("the engine's queue gave fewer messages than it holds")
                return pids
        _, pop_sql = naive_statements(schema + "_naive")
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as c:
            for _ in range(n):
                if (
                    counter.took([r[0] for r in c.execute(pop_sql, (batch,), binary=True).fetchall()])
                    != batch
                ):
                    raise SystemExit("the naive queue gave fewer messages than it holds")
            return {int(c.info.backend_pid)}

    return per_call(server, session, calls) / batch


def count_pushes(
    server: CountedServer, dsn: str, schema: str, *, batch: int, calls: int, who: str, counter: Counter
) -> float:
    """Server instructions a message of a push of ``batch`` on side ``who``, counted as count_pops counts."""

    def session(n: int) -> set[int]:
        if who == "engine":
            with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
                q = dbq.queue(QUEUE)
                with dbq.db.connection() as c:  # type: ignore[attr-defined]
                    pids = {int(c.info.backend_pid)}
                for _ in range(n):
                    q.push_batch(counter.batch(batch))
                return pids
        push_sql, _ = naive_statements(schema + "_naive")
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as c:
            for _ in range(n):
                c.execute(push_sql, (counter.batch(batch),))
            return {int(c.info.backend_pid)}

    return per_call(server, session, calls) / batch


def set_floor(dsn: str, schema: str) -> None:
    """The what-if's schema (FLOOR_SQL), its floor at the process-at time of the queue's first ready
    message, rounded down to the microsecond."""
    w = sql.Identifier(schema + "_whatif")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL(FLOOR_SQL).format(w=w, s=sql.Identifier(schema)))
        c.execute(
            sql.SQL(
                "SELECT setval({}, floor(extract(epoch FROM min(m.process_at)) * 1000000)::bigint) "
                "FROM {}.meta m JOIN {}.queues q USING (queue_id) WHERE q.name = %s AND m.state = 0"
            ).format(sql.Literal(f"{schema}_whatif.floor"), sql.Identifier(schema), sql.Identifier(schema)),
            (QUEUE,),
        )


def count_floor_pops(
    server: CountedServer, dsn: str, schema: str, *, batch: int, calls: int, counter: Counter
) -> float:
    """Server instructions a message of the what-if's pop (FLOOR_SQL), counted as count_pops counts,
    with the statement the engine's pop_payloads runs, on the what-if's function."""
    with psycopg.connect(dsn, autocommit=True) as c:
        qid = c.execute(
            sql.SQL("SELECT queue_id FROM {}.queues WHERE name = %s").format(sql.Identifier(schema)), (QUEUE,)
        ).fetchone()
    assert qid is not None
    stmt = sql.SQL("SELECT r_payload FROM {}.take(%s::integer, %s::integer)").format(
        sql.Identifier(schema + "_whatif")
    )

    def session(n: int) -> set[int]:
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as c:
            for _ in range(n):
                rows = c.execute(stmt, (qid[0], batch), binary=True).fetchall()
                if counter.took([r[0] for r in rows]) != batch:
                    raise SystemExit("the what-if's pop gave fewer messages than the queue holds")
            return {int(c.info.backend_pid)}

    return per_call(server, session, calls) / batch


def count_claims(server: CountedServer, dsn: str, schema: str, batch: int, calls: int) -> dict[str, float]:
    """Server instructions of each side's claim alone (explain_claims's statements, read only, so that
    every run reads the same entries), a statement, counted as the pops are."""
    out = {}
    for who, prepare, call in claim_statements(dsn, schema, batch):

        def session(n: int, prepare: str = prepare, call: str = call) -> set[int]:
            with psycopg.connect(dsn, autocommit=True) as c:
                for s in CLAIM_SETTINGS:
                    c.execute(s)
                c.execute(prepare)
                for _ in range(n):
                    c.execute(call).fetchall()
                return {int(c.info.backend_pid)}

        out[who] = per_call(server, session, calls)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--calls", type=int, default=4, help="pops of the short session (the long one: 4x)")
    p.add_argument("--payload-bytes", type=int, default=300)
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = p.parse_args(argv)
    if args.depth < 2 * FILL_BATCH or args.batch < 1 or args.calls < 1:
        raise SystemExit("need --depth >= 2000, --batch >= 1 and --calls >= 1")
    root = Path(tempfile.mkdtemp(prefix="dbqueue-depth-"))
    root.chmod(0o755)
    schema = f"depth_{uuid.uuid4().hex[:8]}"
    server = CountedServer(root)
    try:
        started = time.monotonic()
        dsn = server.pg.start()
        engine, naive = fill(dsn, schema, args.depth, args.payload_bytes)
        floor_at = raise_floor(dsn, schema) if has_floor(dsn, schema) else None
        fill_s = time.monotonic() - started
        explained = explain_claims(dsn, schema, args.batch)
        with psycopg.connect(dsn) as c:
            version = c.execute("SHOW server_version").fetchone()
        server.pg.stop()
        dsn = server.start(timeout=600)
        counts = {
            who: count_pops(server, dsn, schema, batch=args.batch, calls=args.calls, who=who, counter=counter)
            for who, counter in (("engine", engine), ("naive", naive))
        }
        pushes = {
            who: count_pushes(
                server, dsn, schema, batch=args.batch, calls=args.calls, who=who, counter=counter
            )
            for who, counter in (("engine", engine), ("naive", naive))
        }
        claims = count_claims(server, dsn, schema, args.batch, args.calls)
        set_floor(dsn, schema)
        floor = Counter(0, args.payload_bytes)
        floor_pop = count_floor_pops(server, dsn, schema, batch=args.batch, calls=args.calls, counter=floor)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    ok = engine.bad == 0 and naive.bad == 0 and floor.bad == 0
    out = {
        "point": "depth_count",
        "depth": args.depth,
        "popped_since_vacuum": args.depth // 2,
        "batch": args.batch,
        "calls": args.calls,
        "payload_bytes": args.payload_bytes,
        "server_version": version[0] if version else None,
        "fill_s": round(fill_s, 1),
        "engine_pop_instructions": round(counts["engine"]),
        "naive_pop_instructions": round(counts["naive"]),
        "ratio": round(counts["engine"] / counts["naive"], 3),
        "floor": floor_at,
        "engine_push_instructions": round(pushes["engine"]),
        "naive_push_instructions": round(pushes["naive"]),
        "push_ratio": round(pushes["engine"] / pushes["naive"], 3),
        "engine_claim_instructions": round(claims["engine"]),
        "naive_claim_instructions": round(claims["naive"]),
        "engine_bounded_claim_instructions": round(claims["engine_bounded"]),
        "floor_pop_instructions": round(floor_pop),
        "floor_ratio": round(floor_pop / counts["naive"], 3),
        **explained,
        "engine_popped": engine.popped,
        "naive_popped": naive.popped,
        "floor_popped": floor.popped,
        "payloads_ok": ok,
    }
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        print(
            f"depth {args.depth:,} ({args.depth // 2:,} popped since VACUUM), pop of {args.batch}: "
            f"engine {out['engine_pop_instructions']:,} vs naive {out['naive_pop_instructions']:,} "
            f"server instructions a message ({out['ratio']:.2f}x); push of {args.batch}: "
            f"{out['engine_push_instructions']:,} vs {out['naive_push_instructions']:,} "
            f"({out['push_ratio']:.2f}x); "
            f"claim reads {out['engine_claim_pages']:,} "
            f"index and heap pages vs {out['naive_claim_pages']:,}; payloads {'ok' if ok else 'BAD'}",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
